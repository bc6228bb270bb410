"""benchmarks.prediction: the Predicted Outputs mode of the harness on the tiny pair, end to end through
``python -m benchmarks prediction`` (``benchmarks.cli.main``) (a real local stack and Redis), its summary, verdict and report section."""

from __future__ import annotations

import asyncio
import json

import pytest
import system_fixtures as sf

from benchmarks.cli import main
from benchmarks.prediction import TARGET_SPEEDUP, half_wrong, prediction_section


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.mark.unit
def test_half_wrong_replaces_every_other_block():
    assert half_wrong(list(range(10)), [90, 91, 92], 2) == [0, 1, 92, 90, 4, 5, 90, 91, 8, 9]


async def test_the_mode_runs_through_the_harness_and_renders_its_section(
    pair, redis_server, tmp_path, monkeypatch
):
    # One target step per round: with these tiny models a round trip costs several target steps, so at the
    # default decode_steps the policy rightly prefers four target steps per call to drafting a half-wrong
    # prediction, and this test checks that mode's rejected tokens too.
    monkeypatch.setenv("SPECSERVE_DECODE_STEPS", "1")
    argv = [
        "prediction",
        "--target", str(pair.target_dir),
        "--draft", str(pair.draft_dir),
        "--redis-url", redis_server.url,
        "--out", str(tmp_path),
        "--prompts", "2",
        "--max-new-tokens", "24",
        "--block", "4",
        "--prompt-chars", "200",
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    data = json.loads((tmp_path / "prediction.json").read_text())
    modes = [row["mode"] for row in data["summary"]]
    gamma = data["settings"]["fixed_gamma"]
    assert modes == [
        "gamma=0",
        "prediction",
        f"prediction gamma={gamma}",
        "prediction as text",
        "half-wrong prediction",
        "adaptive",
    ]
    assert len(data["runs"]) == 2 * len(modes)
    assert all(run["tokens"] == 24 and run["identical"] for run in data["runs"]), (
        "greedy output never changes"
    )
    rows = {row["mode"]: row for row in data["summary"]}
    assert rows["prediction"]["accepted_prediction_share"] >= 0.9
    assert rows[f"prediction gamma={gamma}"]["tokens_per_round"] > 4
    assert rows["half-wrong prediction"]["rejected_prediction_share"] > 0
    assert rows["gamma=0"]["speedup"] == pytest.approx(1.0)
    verdict = data["verdict"]
    assert verdict["all_identical"] and verdict["target_speedup"] == TARGET_SPEEDUP
    assert verdict["met"] == (verdict["prediction_speedup"] >= TARGET_SPEEDUP)
    text = (tmp_path / "prediction.md").read_text()
    assert text == "\n".join(prediction_section(data)) and text.startswith("## Predicted Outputs")
    assert "| prediction |" in text and ("is met" in text or "**missed**" in text)
