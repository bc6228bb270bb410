"""benchmarks.invariance on the tiny pair's target: stock and invariant passes timed at every k and context on
each kernel path, each copy's bits checked across decoding steps, one pass and a prefill, and the report renders."""

from __future__ import annotations

import json

import pytest
import system_fixtures as sf

from benchmarks.cli import main

pytestmark = pytest.mark.system


def test_the_invariance_bench_times_both_passes_and_finds_only_the_invariant_ones_the_same_bits(
    tmp_path_factory, tmp_path
):
    pair = sf.tiny_pair(tmp_path_factory)
    argv = [
        "invariance", "--target", str(pair.target_dir), "--kernels", "stock", "onednn", "--contexts", "20", "70", "--ks", "3", "--pairs", "2", "--prefills", "30", "--prefill-pairs", "1", "--prompts", "1", "--max-new-tokens", "6", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "invariance.json").read_text())
    assert set(data["cost"]) == {"stock", "onednn"}
    for per_context in data["cost"].values():
        assert set(per_context) == {"20", "70"}
        for per_k in per_context.values():
            assert set(per_k) == {"1", "3"}
            assert all(row["stock_ms"] > 0 and row["invariant_ms"] > 0 and row["ratio"] > 0 for row in per_k.values())
    assert all(set(per) == {"30"} and per["30"]["ratio"] > 0 for per in data["prefill"].values())
    assert all(len(runs) == 2 for runs in data["greedy"].values())  # one chat and one code prompt per path
    # The invariant passes give the same bits every way; the stock passes are what the check catches.
    assert all(same["invariant"] for same in data["same_bits"].values())
    assert not all(same["stock"] for same in data["same_bits"].values())
    report = (tmp_path / "invariance.md").read_text()
    assert "## Linear kernels `onednn`" in report and "invariant **yes**" in report
    assert "held-out chat and code prompts" in report
