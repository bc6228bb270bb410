"""Constraint domain object: each kind's wire and store round trip, the cheap checks, the size limit first."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specserve.api.constraints import CONSTRAINT_KINDS, MAX_CHOICES, MAX_CONSTRAINT_BYTES, Constraint
from specserve.api.errors import InvalidArgument
from specserve.api.params import SamplingParams
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

EXAMPLES = [
    Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    Constraint("json_object"),
    Constraint("regex", r"[a-z]+@[a-z]+\.com"),
    Constraint("choice", ("yes", "no", "maybe")),
    Constraint("grammar", 'root ::= "a" | "b"'),
]


def test_the_kinds_are_the_wire_oneof():
    assert CONSTRAINT_KINDS == tuple(f.name for f in common_pb2.Constraint.DESCRIPTOR.oneofs_by_name["kind"].fields)
    assert {c.kind for c in EXAMPLES} == set(CONSTRAINT_KINDS)


@pytest.mark.parametrize("constraint", EXAMPLES, ids=lambda c: c.kind)
def test_round_trips_the_wire_the_store_json_and_sampling_params(constraint):
    assert Constraint.from_pb(constraint.to_pb()) == constraint
    assert Constraint.from_dict(json.loads(json.dumps(dataclasses.asdict(constraint)))) == constraint
    params = SamplingParams(temperature=0.5, seed=7, constraint=constraint)
    assert SamplingParams.from_pb(params.to_pb()) == params
    assert SamplingParams.from_dict(json.loads(json.dumps(dataclasses.asdict(params)))) == params
    assert hash(constraint) == hash(Constraint.from_pb(constraint.to_pb()))  # the compile cache's key


def test_absent_means_unconstrained_on_the_wire_and_in_the_store():
    params = SamplingParams(temperature=0.0)
    assert not params.to_pb().HasField("constraint")
    assert SamplingParams.from_pb(params.to_pb()).constraint is None
    assert Constraint.from_pb(common_pb2.Constraint()) is None
    old = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 3}
    assert SamplingParams.from_dict(old).constraint is None  # a record written before constraints


@pytest.mark.parametrize(
    ("kind", "value", "names"),
    [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", "[" * 100_000 + "]" * 100_000, "bytes"),  # over the limit: refused before parsing
        ("regex", "", "regex must not be empty"),
        ("choice", (), "at least one"),
        ("choice", ("a", ""), "empty string"),
        ("choice", "abc", "list of strings"),
        ("choice", tuple(str(i) for i in range(MAX_CHOICES + 1)), f"at most {MAX_CHOICES}"),
        ("grammar", "  \n", "grammar must not be empty"),
        ("json_object", "x", "takes no value"),
        ("yaml", "a: 1", "constraint kind must be one of"),
        ("regex", ("a",), "must be a string"),
    ],
)
def test_bad_constraints_are_refused_naming_the_problem(kind, value, names):
    with pytest.raises(InvalidArgument, match=names):
        Constraint(kind, value)


def test_the_size_limit_counts_utf8_bytes_and_every_choice():
    Constraint("regex", "a" * MAX_CONSTRAINT_BYTES)
    with pytest.raises(InvalidArgument, match=f"{MAX_CONSTRAINT_BYTES + 1} bytes"):
        Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES - 1) + "é")  # 2 bytes in UTF-8
    half = "b" * (MAX_CONSTRAINT_BYTES // 2)
    with pytest.raises(InvalidArgument, match="bytes"):
        Constraint("choice", (half, half, "c"))


def test_json_object_false_on_the_wire_is_refused():
    with pytest.raises(InvalidArgument, match="json_object must be true"):
        Constraint.from_pb(common_pb2.Constraint(json_object=False))
