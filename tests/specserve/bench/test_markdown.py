"""specserve.bench.markdown: the one table renderer and writer of the benchmark reports."""

from __future__ import annotations

import json

import pytest

from specserve.bench import markdown as md

pytestmark = pytest.mark.unit


def test_a_table_has_its_header_rule_and_one_line_per_row():
    lines = md.table(("mode", "ms"), [("gamma=0", "1.50"), ("adaptive", 2)], align=[md.LEFT, md.RIGHT])
    assert lines == ["| mode | ms |", "| --- | ---: |", "| gamma=0 | 1.50 |", "| adaptive | 2 |"]
    assert md.table(("a", "b"), [("x", "")])[-1] == "| x | |"  # an empty cell


def test_alignments_must_match_the_columns():
    with pytest.raises(ValueError, match="2 columns but 1 alignments"):
        md.table(("a", "b"), [], align=[md.LEFT])


def test_write_puts_the_markdown_and_its_json_side_by_side(tmp_path):
    path = md.write(tmp_path / "out", "latency", ["# title", "", *md.command_block("specserve bench latency")], {"a": 1})
    assert path == tmp_path / "out" / "latency.md"
    assert path.read_text() == "# title\n\n```\nspecserve bench latency\n```\n"
    assert json.loads((tmp_path / "out" / "latency.json").read_text()) == {"a": 1}


def test_the_greedy_line_counts_identical_outputs_and_names_the_first_differences():
    runs = [
        {"prompt": "p1", "identical": True, "first_difference": None},
        {"prompt": "p2", "identical": False, "first_difference": 7},
    ]
    same, text = md.greedy_line(runs, 32, " between the two paths")
    assert same == 1 and text.endswith("(EOS ignored) between the two paths: **1 of 2 token-identical**")
    assert md.first_differences(runs) == "p2: token 7"
