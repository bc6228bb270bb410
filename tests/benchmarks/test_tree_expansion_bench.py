"""benchmarks.tree_expansion: its budgets parse or are refused by name, and its report has a row per arm."""

from __future__ import annotations

import pytest

from benchmarks.options import TreeExpansionOptions, parse_budget
from benchmarks.tree_expansion import render

pytestmark = pytest.mark.unit


def test_a_budget_is_alternatives_and_a_threshold():
    assert parse_budget("8:0.05") == (8, 0.05)
    for bad in ("8", "8:", "x:0.1", "8:0.1:2"):
        with pytest.raises(ValueError, match="ALTERNATIVES:THRESHOLD"):
            parse_budget(bad)
    with pytest.raises(ValueError, match="--budgets"):
        TreeExpansionOptions(budgets=["16"])


def test_the_report_has_both_arms_of_every_budget_and_set():
    row = {"tau": 2.5, "nodes_per_round": 7.94, "per_depth": [0.7, 0.38, 0.26, 0.18], "drafted_rounds": 10,
           "head_passes_per_round": 5.5, "head_positions_per_round": 30.25}  # fmt: skip
    data = {
        "command": "python -m benchmarks tree-expansion",
        "date_utc": "2026-12-07 00:00",
        "machine": "x86_64",
        "head": "h",
        "settings": {"threads": 2, "prompts": 1, "max_new_tokens": 8, "gamma": 4},
        "sets": ["chat", "code"],
        "results": {kind: {"8:0.05": {"leaves": row, "expanded": row}} for kind in ("chat", "code")},
    }
    text = render(data)
    assert text.count("\n| ") == 2 + 2 * 2  # header, rule, two arms for each set
    assert "gamma + 8 nodes, path >= 0.05" in text and "0.70 / 0.38 / 0.26 / 0.18" in text and "| 30.2" in text
