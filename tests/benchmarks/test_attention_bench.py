"""benchmarks.attention on the tiny pair's target (grouped-query attention): both copies are timed at every k and
context, every pass compared bit for bit, greedy output compared token for token, and the report renders."""

from __future__ import annotations

import json

import pytest
import system_fixtures as sf

from benchmarks.cli import main

pytestmark = pytest.mark.system


def test_the_attention_bench_measures_both_copies_and_finds_the_same_bits(tmp_path_factory, tmp_path):
    pair = sf.tiny_pair(tmp_path_factory)
    argv = [
        "attention", "--target", str(pair.target_dir), "--kernels", "stock", "--contexts", "8", "20", "--pairs", "3", "--max-k", "3", "--prompts", "1", "--max-new-tokens", "6", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert set(data["pass_ms"]) == {"8", "20"}
    for per in data["pass_ms"].values():
        assert set(per) == {"sdpa", "grouped"}
        assert all(set(ms) == {"1", "2", "3"} and min(ms.values()) > 0 for ms in per.values())
    assert all(set(r) == {"1", "2", "3"} and min(r.values()) > 0 for r in data["pair_ratio"].values())
    assert all(all(same.values()) for same in data["same_bits"].values())
    assert len(data["greedy"]) == 2 and all(g["identical"] for g in data["greedy"])
    report = (tmp_path / "attention.md").read_text()
    assert "## Context 20 tokens" in report and "**2 of 2 token-identical**" in report
