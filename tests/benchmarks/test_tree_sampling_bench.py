"""benchmarks.tree_sampling: its options refuse what no run can do, and its report has a row per arm."""

from __future__ import annotations

import pytest

from benchmarks.options import TreeSamplingOptions
from benchmarks.tree_sampling import ARMS, render

pytestmark = pytest.mark.unit


def test_the_options_refuse_greedy_and_no_seeds_by_name():
    with pytest.raises(ValueError, match="--temperature"):
        TreeSamplingOptions(temperature=0.0)
    with pytest.raises(ValueError, match="--seeds"):
        TreeSamplingOptions(seeds=0)
    with pytest.raises(ValueError, match="--budgets"):
        TreeSamplingOptions(budgets=["16"])


def test_the_report_has_both_arms_of_every_budget_and_set():
    def row(tau):
        return {"tau": tau, "nodes_per_round": 18.86, "per_depth": [0.605, 0.29, 0.148, 0.041],
                "drafted_rounds": 365, "tokens": 700}  # fmt: skip

    data = {
        "command": "python -m benchmarks tree-sampling",
        "date_utc": "2026-12-07 00:00",
        "machine": "x86_64",
        "head": "h",
        "settings": {"threads": 2, "prompts": 8, "seeds": 2, "max_new_tokens": 48, "gamma": 4, "temperature": 0.7},
        "sets": ["chat", "code"],
        "results": {k: {"16:0.02": {ARMS[0]: row(2.085), ARMS[1]: row(1.9)}} for k in ("chat", "code")},
    }
    text = render(data)
    assert text.count("\n| ") == 2 + 2 * 2  # header, rule, two arms for each set
    assert "(T = 0.7)" in text and "8 held-out prompts per set x 2 seeds" in text
    assert "| chat | gamma + 16 nodes, path >= 0.02 | drawn chain | 2.085 | 365 | 18.9 | 0.60 / 0.29 / 0.15 / 0.04 |" in text
    assert "| code | gamma + 16 nodes, path >= 0.02 | ranked | 1.900 |" in text
