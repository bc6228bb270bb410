"""The feature head in the harness's sweeps: which modes run (specserve.bench.modes), the figures every head
row carries (specserve.bench.head_projection) and how the report renders them (specserve.bench.report)."""

from __future__ import annotations

import pytest

from specserve.bench import head_card, head_projection, report
from specserve.bench.modes import (
    ADAPTIVE,
    GAMMA0,
    LOAD_ADAPTIVE,
    LOAD_CONTROL,
    fixed,
    latency_modes,
    load_modes,
    may_use_head,
)

pytestmark = pytest.mark.unit

HEAD = {"head": "/models/specserve-smollm2-head", "hidden": 576, "head_over_target_step": 0.1}


def test_the_load_sweep_adds_the_head_only_where_a_head_gamma_is_given():
    assert load_modes(4, False) == [GAMMA0, fixed(4), LOAD_ADAPTIVE]
    modes = load_modes(4, True, head_gamma=2)
    assert modes == [GAMMA0, fixed(4), LOAD_ADAPTIVE, fixed(2, "feature"), LOAD_CONTROL]
    head = modes[3]
    assert head.name == "specserve feature gamma=2" and head.request()["proposer"] == "feature"
    assert head.request()["gamma"] == 2


def test_the_rtt_sweep_names_its_modes_as_its_tables_always_have_and_gives_the_head_no_overlap_twin():
    plain = latency_modes(1, 2, overlap=False)
    assert [m.name for m in plain] == ["gamma=0", "gamma=1", "adaptive", "feature gamma=2"]
    assert [m.proposer for m in plain] == ["model", "model", "model", "feature"]  # never the server's default
    assert [(m.gamma, m.proposer) for m in plain] == [(0, "model"), (1, "model"), (None, "model"), (2, "feature")]
    assert [m.name for m in latency_modes(1, 2, overlap=True)] == ["gamma=1 +overlap", "adaptive +overlap"]
    assert [m.name for m in latency_modes(1, None, overlap=False)] == ["gamma=0", "gamma=1", "adaptive"]


def test_a_mode_may_use_the_head_where_it_names_it_or_leaves_the_proposer_to_the_server():
    assert may_use_head(fixed(2, "feature")) and may_use_head(ADAPTIVE)
    assert not may_use_head(fixed(4)) and not may_use_head(LOAD_ADAPTIVE) and not may_use_head(fixed(4, "ngram"))


def test_the_wire_projection_keeps_the_rows_per_token_and_scales_the_row():
    # 1.5 rows of 576 float16 values per committed token
    got = head_projection.wire_mb_per_s(1.5 * 576 * 2, 576)
    assert got == {
        "4096": pytest.approx(1.5 * 4096 * 2 * 10_000 / 1e6),
        "8192": pytest.approx(1.5 * 8192 * 2 * 10_000 / 1e6),
    }
    with pytest.raises(ValueError):
        head_projection.wire_mb_per_s(100.0, 0)


def test_head_figures_come_from_the_counts_and_are_absent_where_nothing_was_relayed():
    counts = dict(committed=100, to_draft_bytes=115_200, from_target_bytes=120_960, proposed=80, accepted=20,
                  draft_rounds=40)  # fmt: skip
    f = head_projection.figures(HEAD, **counts)
    assert f is not None
    assert f["bytes_per_token"] == pytest.approx(1152.0) and f["bytes_from_target_per_token"] == pytest.approx(1209.6)
    assert f["accepted_per_round"] == pytest.approx(0.5) and f["drafted_per_round"] == pytest.approx(2.0)
    # (0.5 + 1) tokens per drafted round over 2 x 0.1 + verify steps
    assert f["speedup"] == {"1.05": pytest.approx(1.5 / 1.25), "1.2": pytest.approx(1.5 / 1.4)}
    assert f["wire_mb_per_s"]["8192"] == pytest.approx(8192 * 2 * 10_000 / 1e6)  # one row per token
    assert head_projection.figures(None, **counts) is None
    assert head_projection.figures(HEAD, **(counts | {"to_draft_bytes": 0})) is None
    no_card = head_projection.figures(HEAD | {"head_over_target_step": None}, **counts)
    assert no_card is not None and no_card["speedup"] is None
    assert head_projection.cells(no_card)[-2:] == ["-", "-"]


def test_the_card_and_the_harness_project_with_the_same_function():
    """The head card's projected speedup for a gamma is the harness's for a run of that gamma's counts."""
    card = {
        "feature_row_bytes": 1152,
        "costs": {"head_over_target_step": 0.1},
        "chat": {"greedy": {"2": {"feature_bytes_per_token": 1152.0, "accepted_per_round": 0.5}}},
        "code": {"greedy": {"2": {"feature_bytes_per_token": 1152.0, "accepted_per_round": 0.25}}},
    }
    proj = head_card.projections(card)
    f = head_projection.figures(HEAD, committed=10, to_draft_bytes=11_520, from_target_bytes=11_520, proposed=8,
                                accepted=2, draft_rounds=4)  # fmt: skip
    assert f is not None and f["speedup"] == pytest.approx(proj["speedup"]["chat"]["2"])
    assert f["wire_mb_per_s"] == pytest.approx(proj["wire_mb_per_s"])


def _point(mode: str, repeat: int, relayed: int) -> dict:
    return {
        "mode": mode, "rate_rps": 2.0, "repeat": repeat, "requests": 4, "completed": 4, "errors": 0,
        "duration_s": 2.0, "throughput_tok_s": 50.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": 0.02,
        "itl_p99_s": 0.05, "queue_p50_s": 0.0, "committed_tokens": 100, "proposed_tokens": 40,
        "accepted_tokens": 10, "wasted_tokens": 30, "target_positions": 150, "target_forward_passes": 60,
        "draft_rounds": 20, "feature_bytes_to_draft": relayed, "feature_bytes_from_target": relayed,
    }  # fmt: skip


def test_the_load_section_gives_the_head_rows_their_bytes_summed_over_repeats():
    run = {
        "settings": {"max_new_tokens": 32, "duration_s": 2.0},
        "head": HEAD,
        "load": [_point(m, r, 115_200 if "feature" in m else 0) for r in (0, 1)
                 for m in ("specserve gamma=0", "specserve adaptive", "specserve feature gamma=2")],
    }  # fmt: skip
    figures = report.load_head_figures(run)
    assert list(figures) == [(2.0, "specserve feature gamma=2")]
    assert figures[(2.0, "specserve feature gamma=2")]["bytes_per_token"] == pytest.approx(1152.0)
    text = "\n".join(report.load_section(run))
    assert "| 2 | specserve feature gamma=2 | 1152 | 1152 | 82 | 164 | 1.20x | 1.07x |" in text
    assert "Projections, not measurements" in text and "specserve-smollm2-head" in text
    assert "feature" not in "\n".join(report.load_section(run | {"load": run["load"][:2]}))


def test_the_single_section_lists_the_modes_that_drafted_with_the_head():
    f = head_projection.figures(HEAD, committed=100, to_draft_bytes=115_200, from_target_bytes=115_200,
                                proposed=80, accepted=20, draft_rounds=40)  # fmt: skip
    row = {"ms_per_token_median": 30.0, "ms_per_token_q1": 29.0, "ms_per_token_q3": 31.0, "acceptance": 0.25,
           "tokens_per_round": 1.5, "n": 2}  # fmt: skip
    run = {
        "command": "specserve bench single", "settings": {"prompts": 2, "max_new_tokens": 32, "repeats": 1},
        "feature_head": True, "head": HEAD, "greedy_identity": {"identical": 4, "total": 4},
        "single_stream": {"chat T=0": {"specserve gamma=0": row, "specserve feature gamma=2": row | {"head": f},
                                       "specserve adaptive": row | {"head": f}}},
    }  # fmt: skip
    text = "\n".join(report.single_section(run))
    assert "| chat T=0 | specserve feature gamma=2 | 1152 | 1152 | 82 | 164 | 1.20x | 1.07x |" in text
    assert "| chat T=0 | specserve adaptive | 1152 |" in text
    assert "| chat T=0 | specserve gamma=0 | 1152" not in text


def test_greedy_identity_is_against_gamma_0_where_no_hf_baseline_ran():
    from specserve.bench.harness import GreedyIdentity, Run

    def run(mode: str, tokens: list[int], temperature: float = 0.0) -> Run:
        return Run(mode, "chat", "p1", temperature, len(tokens), 1.0, 0.1, token_ids=tokens)

    runs = [run("specserve gamma=0", [1, 2, 3]), run("specserve feature gamma=2", [1, 2, 3]),
            run("specserve adaptive", [1, 2, 4]), run("specserve feature gamma=4", [9], 0.7)]  # fmt: skip
    alone = GreedyIdentity.of(runs)
    assert (alone.identical, alone.total, alone.reference) == (1, 2, "specserve gamma=0")
    with_hf = GreedyIdentity.of([*runs, run("hf target-only", [1, 2, 4])])
    assert (with_hf.identical, with_hf.total, with_hf.reference) == (1, 3, "hf target-only")


def test_a_runs_load_average_is_said_where_it_was_recorded():
    from specserve.bench import markdown as md

    assert md.load_line({}) == ""
    line = md.load_line({"load_average": {"before": [2.5, 2.0, 1.0], "after": [3.0, 2.25, 1.5], "cpus": 2}})
    assert line == "Load average (1/5/15 min, as `uptime` gives it) on 2 CPUs: 2.50/2.00/1.00 before the run, 3.00/2.25/1.50 after."
