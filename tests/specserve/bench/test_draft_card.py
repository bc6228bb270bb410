"""specserve.bench.draft_card: the model card is rendered from the benchmark's JSON and the training metadata,
every figure from those files, and the verdicts on the draft's targets follow the figures."""

from __future__ import annotations

import pytest

from specserve.bench.draft_card import render_card

pytestmark = pytest.mark.unit


def _card(chat_acceptance: float, target_ms: float) -> dict:
    sets = {
        "prompts": 20,
        "greedy_tokens": 2000,
        "max_new_tokens": 128,
        "greedy": {"1": {"acceptance": 0.81}, "4": {"acceptance": chat_acceptance}},
        "t0.7": {"2": {"acceptance": 0.44}},
        "t0.7_prompts": 6,
        "t0.7_max_new_tokens": 48,
    }
    return {
        "when": "2026-11-30T10:00:00+00:00",
        "machine": {"cpu": "x86_64", "threads": 2},
        "command": "python -m specserve.bench.draft_card --json card.json",
        "costs": {
            "target_step_ms": target_ms,
            "draft_step_ms": 5.0,
            "context_tokens": 128,
            "verify_k_over_target_step": {"1": 1.0, "2": 1.8},
        },
        "chat": sets,
        "code": sets,
    }


META = {
    "step": 240,
    "history": [
        {"step": 0, "time_s": 0.0, "loss": 24.0, "kl": 16.0, "top1_agreement": 0.03},
        {"step": 240, "time_s": 2640.0, "loss": 3.1, "kl": 2.2, "top1_agreement": 0.61},
    ],
    "heldout_top1_coverage": 0.9,
    "train_rows": 2600,
    "train_positions": 400000,
    "args": {
        "layers": "2",
        "head_size": "8192",
        "embed_rank": "128",
        "ce_weight": "0.5",
        "lr": "0.0008",
        "batch_size": "48",
    },
    "generate_args": {"limit": 2000, "max_new_tokens": 160, "gen_dtype": "bfloat16"},
}


def test_the_card_carries_the_figures_and_the_commands():
    text = render_card(_card(0.62, 61.0), META)
    assert "| 4 | 0.620 | 0.620 | - | - |" in text and "| 2 | - | - | 0.440 | 0.440 |" in text
    assert "**ratio 12.2**" in text and "400,000 generated positions" in text
    assert "KL 16.00 -> 2.20" in text and "| 240 | 44 | 3.100 | 2.200 | 0.610 |" in text
    assert "distill_draft.py generate --limit 2000 --max-new-tokens 160" in text
    assert "python -m specserve.bench.draft_card --json card.json" in text


def test_the_verdicts_follow_the_figures():
    met = render_card(_card(0.62, 61.0), META)
    assert "0.620 (target: at least 0.55" in met and met.count("**met**") == 2
    missed = render_card(_card(0.31, 30.0), META)
    assert missed.count("**missed**") == 2 and "ratio 6.0" in missed
