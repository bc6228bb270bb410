"""specserve.bench.report: the bound table's GPU-like projection and the load sweep's medians and paired ratios
(no models, no servers)."""

from __future__ import annotations

import pytest

from specserve.bench.costs import Costs, predicted_speedup
from specserve.bench.report import (
    GPU_LIKE_VERIFY,
    bound_rows,
    gpu_like,
    load_ratios,
    load_rows,
    load_section,
    round_parts_section,
    targets,
)

pytestmark = pytest.mark.unit

#: The default pair's costs on the development machine (specserve.bench.costs, one run): a 2-position pass ~1.7 steps.
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


def test_a_rounds_time_is_split_into_the_parts_the_bound_counts_and_the_rest():
    """Two runs of 10 rounds each at gamma 2: the service's draft, verify and forward time per round beside
    the bound's (2 draft steps, a pass over 3 positions); 'other' is the round's remainder."""
    runs = [
        {
            "mode": "specserve gamma=2",
            "prompt_set": "chat",
            "temperature": 0.0,
            "rounds": 10,
            "accepted": 6,
            "total_s": total,
            "draft_s": 0.2,
            "verify_s": 1.4,
            "forward_s": 1.2,
        }
        for total in (1.8, 2.0)
    ]
    data = {
        "costs": {"target_step_ms": 62.0, "draft_step_ms": 6.0, "verify_ms": CPU.verify_ms},
        "single_stream": {
            "chat T=0": {
                "hf target-only": {"ms_per_token_median": 62.0},
                "specserve gamma=2": {"ms_per_token_median": 100.0},
            }
        },
        "runs": runs,
    }
    (row,) = bound_rows(data)
    assert row["round_ms"] == pytest.approx(
        {"draft": 20.0, "verify": 140.0, "forward": 120.0, "total": 190.0, "other": 30.0}
    )
    assert row["model_round_ms"] == pytest.approx({"draft": 12.0, "verify": 126.0})  # verify_ms[2]: 3 positions
    text = "\n".join(round_parts_section([row]))
    assert "| chat T=0 | 2 | 20.0 (12.0) | 140.0 (126.0) | 120.0 | 30.0 | 190.0 (138.0) |" in text
    assert round_parts_section([{k: v for k, v in row.items() if k != "round_ms"}]) == []  # older runs: none


def test_with_the_draft_timed_after_a_target_pass_the_report_gives_a_second_bound():
    """A run that timed the draft step after a target pass (6 ms against 3 back to back): every bound row
    carries the bound with that step and the efficiency against it, and the round-parts table both draft
    bounds; the targets stay judged against the first bound."""
    run = {
        "mode": "specserve gamma=2", "prompt_set": "chat", "temperature": 0.0, "rounds": 10, "accepted": 6,
        "total_s": 1.9, "draft_s": 0.2, "verify_s": 1.4, "forward_s": 1.2,
    }  # fmt: skip
    costs = {
        "target_step_ms": 62.0, "draft_step_ms": 3.0, "verify_ms": CPU.verify_ms,
        "draft_step_after_target_ms": 6.0, "draft_threads": 1,
    }  # fmt: skip
    data = {
        "costs": costs,
        "single_stream": {
            "chat T=0": {
                "hf target-only": {"ms_per_token_median": 62.0},
                "specserve gamma=2": {"ms_per_token_median": 100.0},
            }
        },
        "runs": [run],
        "load": [],
    }
    (row,) = bound_rows(data)
    dear = Costs(target_step_ms=62.0, draft_step_ms=6.0, verify_ms=CPU.verify_ms)
    assert row["predicted_as_run"] == pytest.approx(predicted_speedup(row["alpha"], 2, dear))
    assert row["predicted_as_run"] < row["predicted"]
    assert row["efficiency_as_run"] == pytest.approx(row["measured"] / row["predicted_as_run"])
    assert row["efficiency_as_run"] > row["efficiency"]
    assert row["model_round_ms"] == pytest.approx({"draft": 6.0, "draft_as_run": 12.0, "verify": 126.0})
    text = "\n".join(round_parts_section([row]))
    assert "| chat T=0 | 2 | 20.0 (6.0; 12.0) | 140.0 (126.0) | 120.0 | 30.0 | 190.0 (132.0; 138.0) |" in text
    (check,) = [t for t in targets(data) if "efficiency" in t[0]]
    assert check[2] == f"{row['efficiency']:.0%}"


def _point(rate: float, mode: str, repeat: int, tok_s: float) -> dict:
    zero = dict.fromkeys(
        ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "queue_p50_s", "target_forward_passes",
         "target_positions", "proposed_tokens", "accepted_tokens", "wasted_tokens"),
        0.0,
    )  # fmt: skip
    return zero | {
        "rate_rps": rate, "mode": mode, "repeat": repeat, "throughput_tok_s": tok_s,
        "requests": 4, "completed": 4, "errors": 0,
    }  # fmt: skip


#: Three interleaved repeats at one rate: the machine slowed in repeat 1 for both modes alike.
SWEEP = [
    _point(2.0, "specserve gamma=0", 0, 40.0),
    _point(2.0, "specserve adaptive", 0, 42.0),
    _point(2.0, "specserve adaptive", 1, 31.0),
    _point(2.0, "specserve gamma=0", 1, 30.0),
    _point(2.0, "specserve gamma=0", 2, 44.0),
    _point(2.0, "specserve adaptive", 2, 43.0),
]


def _load_checks(points: list[dict]) -> list[tuple[str, bool, str]]:
    costs = {
        "target_step_ms": CPU.target_step_ms,
        "draft_step_ms": CPU.draft_step_ms,
        "verify_ms": CPU.verify_ms,
    }
    data = {"single_stream": {}, "runs": [], "costs": costs, "load": points}
    return [t for t in targets(data) if t[0].startswith("load")]


def test_load_rows_give_medians_over_repeats_and_the_range():
    rows = {r["mode"]: r for r in load_rows(SWEEP)}
    assert rows["specserve gamma=0"]["throughput_tok_s"] == 40.0
    assert (rows["specserve gamma=0"]["throughput_min"], rows["specserve gamma=0"]["throughput_max"]) == (
        30,
        44,
    )
    assert rows["specserve adaptive"]["throughput_tok_s"] == 42.0
    assert rows["specserve adaptive"]["repeats"] == 3 and rows["specserve adaptive"]["requests"] == 12


def test_the_load_check_pairs_each_repeat_and_takes_the_median_ratio():
    """Paired within a repeat, the slow repeat does not decide: ratios 1.05, 1.033, 0.977 -> median 1.033
    (met); unpaired, the slow adaptive point against a fast gamma 0 point would read 0.70."""
    (ratios,) = load_ratios(SWEEP).values()
    assert ratios == pytest.approx([42 / 40, 31 / 30, 43 / 44])
    (check,) = _load_checks(SWEEP)
    assert check[1] is True and "1.03" in check[2] and "0.98-1.05 over 3 repeats" in check[2]
    behind = [
        p | {"throughput_tok_s": p["throughput_tok_s"] * 0.9} if "adaptive" in p["mode"] else p for p in SWEEP
    ]
    (check,) = _load_checks(behind)
    assert check[1] is False


def test_a_separate_load_run_names_its_command_in_the_section():
    """A ``specserve bench load`` run's own settings (``max_new_tokens``, ``duration_s``), where a full run's
    are ``load_max_new_tokens`` and ``load_duration_s`` (the A/A test below)."""
    run = {
        "command": "specserve bench load --repeats 3",
        "date_utc": "2026-11-30 16:00",
        "prompt_set": "chat",
        "settings": {"max_new_tokens": 32, "duration_s": 8.0, "repeats": 3},
        "load": SWEEP,
    }
    text = "\n".join(load_section(run))
    assert "specserve bench load --repeats 3" in text and "measured 3 time(s)" in text
    assert "32 tokens per request, 8 s per point" in text
    assert "| 2 | 1.05, 1.03, 0.98 | 1.03 |" in text


def test_the_a_a_control_is_reported_beside_the_ratio():
    """With gamma 0 measured twice (--load-control), the check and the table give its ratio to itself."""
    control = [
        _point(2.0, "specserve gamma=0 (again)", 0, 41.0),
        _point(2.0, "specserve gamma=0 (again)", 1, 29.0),
        _point(2.0, "specserve gamma=0 (again)", 2, 44.0),
    ]
    (check,) = _load_checks(SWEEP + control)
    assert "gamma 0 against itself: 0.97-1.02, median 1.00" in check[2]
    run = {"settings": {"load_max_new_tokens": 32, "load_duration_s": 8.0}, "load": SWEEP + control}
    text = "\n".join(load_section(run))
    assert "| 2 | 1.05, 1.03, 0.98 | 1.03 | 1.02, 0.97, 1.00 | 1.00 |" in text
