"""bench.report: the bound table's GPU-like projection (no models, no servers)."""

from __future__ import annotations

import pytest

from bench.costs import Costs, predicted_speedup
from bench.report import GPU_LIKE_VERIFY, bound_rows, gpu_like

#: The default pair's costs on the development machine (bench.costs, one run): a 2-position pass ~1.7 steps.
CPU = Costs(
    target_step_ms=62.0,
    draft_step_ms=6.0,
    verify_ms=[62.0, 105.0, 126.0, 92.0, 92.0, 114.0, 151.0, 133.0, 116.0],
)


def test_the_projection_swaps_only_the_verify_curve():
    projected = gpu_like(CPU)
    assert projected.target_step_ms == CPU.target_step_ms and projected.draft_step_ms == CPU.draft_step_ms
    assert projected.verify_ms == pytest.approx([62.0 * r for r in GPU_LIKE_VERIFY])
    assert projected.verify_ms[0] == CPU.target_step_ms


def test_bound_rows_carry_the_projection_beside_the_measured_bound():
    """One set, gamma 2, 0.6 accepted per round over 10 rounds at 100 ms/token against HF's 62."""
    run = {"mode": "specserve gamma=2", "prompt_set": "chat", "temperature": 0.0, "rounds": 10, "accepted": 6}
    data = {
        "costs": {
            "target_step_ms": CPU.target_step_ms,
            "draft_step_ms": CPU.draft_step_ms,
            "verify_ms": CPU.verify_ms,
        },
        "single_stream": {
            "chat T=0": {
                "hf target-only": {"ms_per_token_median": 62.0},
                "specserve gamma=2": {"ms_per_token_median": 100.0},
            }
        },
        "runs": [run],
    }
    (row,) = bound_rows(data)
    assert row["measured"] == pytest.approx(0.62)
    assert row["predicted"] == pytest.approx(predicted_speedup(row["alpha"], 2, CPU))
    assert row["gpu_projection"] == pytest.approx(predicted_speedup(row["alpha"], 2, gpu_like(CPU)))
    assert row["predicted"] < 1.0 < row["gpu_projection"]  # this acceptance loses here and would win there
