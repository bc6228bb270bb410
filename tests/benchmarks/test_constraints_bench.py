"""The validity set (tests/data/constraints) and benchmarks.constraints (xgrammar, llguidance and specserve's engine).

The set: its sizes and shapes as issue 41 asks (at least 30 JSON schemas of varied shape, 10 regexes,
5 choice lists), every schema a valid draft 2020-12 schema and every example valid under its constraint
(the check the system tests apply to outputs), and :meth:`Case.valid` refusing what is not valid. The
bench: both engines compile the tiny tokenizer's constraints, walk each example's tokens and report.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import system_fixtures as sf

from benchmarks import constraints as bench
from benchmarks.cli import main

SET = Path(__file__).resolve().parents[1] / "data" / "constraints"


def _keywords(schema: object) -> set[str]:
    """Every key used anywhere in ``schema`` (a JSON value)."""
    if isinstance(schema, dict):
        return set(schema) | {k for v in schema.values() for k in _keywords(v)}
    if isinstance(schema, list):
        return {k for v in schema for k in _keywords(v)}
    return set()


def _has_nested_object(schema: dict) -> bool:
    props = schema.get("properties", {})
    return any(isinstance(p, dict) and p.get("type") == "object" for p in props.values())


def _has_optional_key(schema: dict) -> bool:
    return bool(set(schema.get("properties", {})) - set(schema.get("required", [])))


@pytest.mark.unit
def test_the_set_has_the_sizes_and_shapes_issue_41_asks_for():
    cases = bench.load_set(SET)
    kinds = [c.kind for c in cases]
    assert kinds.count("json_schema") >= 30 and kinds.count("regex") >= 10 and kinds.count("choice") >= 5
    assert len({(c.kind, c.name) for c in cases}) == len(cases)  # names are unique per kind
    schemas = [c.value for c in cases if c.kind == "json_schema"]
    used = set().union(*(_keywords(s) for s in schemas))
    # Arrays with bounds, enums, anyOf, string patterns, numbers with ranges.
    assert {"minItems", "maxItems", "enum", "anyOf", "pattern", "minimum", "maximum"} <= used
    assert sum(_has_nested_object(s) for s in schemas) >= 3
    assert sum(_has_optional_key(s) for s in schemas) >= 3
    assert sum("required" in s for s in schemas) >= 20
    assert {s.get("type") for s in schemas} >= {"object", "array", "integer", "string", None}


@pytest.mark.unit
def test_every_schema_is_valid_and_every_example_satisfies_its_constraint():
    for case in bench.load_set(SET):
        if case.kind == "json_schema":
            jsonschema.Draft202012Validator.check_schema(case.value)
        assert case.valid(case.example), (case.kind, case.name)
    for entry in json.loads((SET / bench.UNENFORCEABLE_FILE).read_text()):
        jsonschema.Draft202012Validator.check_schema(entry["schema"])


@pytest.mark.unit
def test_validity_refuses_what_the_constraint_does_not_allow():
    cases = {(c.kind, c.name): c for c in bench.load_set(SET)}
    person = cases[("json_schema", "flat_person")]
    assert person.valid('{"name": "Ada", "age": 36}')
    assert not person.valid('{"name": "Ada", "age": 121}')  # out of range
    assert not person.valid('{"name": "Ada"}')  # a required key missing
    assert not person.valid('{"name": "A\x0bda", "age": 36}')  # a raw control character: not JSON
    assert not person.valid('{"name": "Ada", "age": 36')  # cut short
    assert not cases[("regex", "phone")].valid("555-12345")  # the whole text must match
    assert not cases[("choice", "shared_prefixes")].valid("cata")


@pytest.mark.system
def test_the_bench_measures_both_engines_on_the_tiny_tokenizer(tmp_path_factory, tmp_path):
    """A cut-down set (two schemas, a regex, a choice list, one unenforceable schema) on the tiny
    pair's tokenizer: both engines compile, time masks along the example, walk, and the report renders."""
    pair = sf.tiny_pair(tmp_path_factory)
    small = tmp_path / "set"
    small.mkdir()
    for name, keep in (
        ("json_schemas.json", 2),
        ("regexes.json", 1),
        ("choices.json", 1),
        ("unenforceable.json", 1),
    ):
        (small / name).write_text(json.dumps(json.loads((SET / name).read_text())[:keep]))
    argv = [
        "constraints",
        "--target",
        str(pair.target_dir),
        "--set",
        str(small),
        "--repeats",
        "2",
        "--walks",
        "3",
        "--byte-walks",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    data = json.loads((tmp_path / "constraint_engines.json").read_text())
    assert set(data["engines"]) == {"xgrammar", "llguidance", "specserve"}
    assert [row["kind"] for row in data["cases"]] == ["json_schema", "json_schema", "regex", "choice"]
    for row in data["cases"]:
        for engine in ("xgrammar", "llguidance", "specserve"):
            result = row[engine]
            assert "error" not in result and not result.get("example_refused"), (row["name"], engine, result)
            assert result["compile_ms"] > 0 and result["mask_us_median"] >= 0
            assert result["walks"] == 3 and 0 <= result["valid"] <= result["stopped"] <= 3
            assert result["byte_walks"] == 2 and 0 <= result["byte_valid"] <= result["byte_stopped"] <= 2
    assert data["unenforceable"][0]["name"] == "not"
    assert "refused" in data["unenforceable"][0]["llguidance"] and "refused" in data["unenforceable"][0]["specserve"]
    report = (tmp_path / "constraint_engines.md").read_text()
    assert "| xgrammar | all | 4 |" in report and "## Keywords a mask does not enforce" in report
