"""benchmarks.sampling_modes: the coupled-against-optimal comparison runs end to end on a tiny pair.

``python -m benchmarks sampling-modes`` against the tiny test pair (a real local
stack, the session's Redis), a few tokens per generation: the JSON and the
Markdown section are written, every (set, temperature, gamma) has both modes,
the live drafter-invariance check holds, and the verdict follows the 5% rule.
The figures themselves mean nothing for models this small; the real
measurement is run on the default pair (docs/benchmarks).
"""

from __future__ import annotations

import json

import pytest
import system_fixtures as sf

from benchmarks import cli, sampling_modes


@pytest.fixture
def quiet_logging(monkeypatch):
    import specserve.runtime.logs

    monkeypatch.setattr(specserve.runtime.logs, "configure_logging", lambda *a, **k: None)


def test_only_sampling_modes_writes_json_and_report(tmp_path_factory, tmp_path, redis_server, quiet_logging):
    pair = sf.tiny_pair(tmp_path_factory)
    args = [
        "sampling-modes", "--target", str(pair.target_dir), "--draft", str(pair.draft_dir),
        "--redis-url", redis_server.url, "--out", str(tmp_path), "--prompts", "1",
        "--max-new-tokens", "12", "--gammas", "auto", "3", "--prompt-chars", "200",
        "--prompt-sets", "code", "prose",
    ]  # fmt: skip
    assert cli.main(args) == 0
    data = json.loads((tmp_path / "sampling_modes.json").read_text())
    modes = data["sampling_modes"]
    assert modes["temperatures"] == [0.7, 1.0] and modes["gammas"] == ["auto", "3"]
    assert set(modes["prompt_sets"]) == {"code", "prose"}
    assert len(modes["runs"]) == 2 * 2 * 2 * 2  # sets x temperatures x gammas x modes, one prompt each
    for key in ("code T=0.7 gamma=3", "prose T=1 gamma=auto", "all T=0.7 gamma=auto"):
        group = modes["groups"][key]
        assert group["optimal"]["n"] >= 1 and group["coupled"]["n"] >= 1
        assert group["coupled_throughput_vs_optimal"] > 0
    fixed = modes["groups"]["all T=1 gamma=3"]
    assert fixed["optimal"]["acceptance"] is not None and fixed["coupled"]["acceptance"] is not None
    assert modes["coupled_identical"] == {"identical": 4, "total": 4}
    v = modes["verdict"]
    assert set(v["losses"]) == {"all T=0.7 gamma=auto", "all T=1 gamma=auto"}
    assert v["default"] == ("coupled" if v["worst_loss"] < 0.05 else "optimal")
    report = (tmp_path / "sampling_modes.md").read_text()
    assert "## Sampling modes: coupled against optimal" in report
    assert "4 of 4 (prompt, temperature) pairs gave the same coupled output" in report
    assert f"**Default: `{v['default']}`.**" in report


@pytest.mark.unit
def test_the_verdict_keeps_optimal_unless_coupled_loses_under_five_percent():
    def groups(ratio_07, ratio_10):
        return {
            "all T=0.7 gamma=auto": {"coupled_throughput_vs_optimal": ratio_07},
            "all T=1 gamma=auto": {"coupled_throughput_vs_optimal": ratio_10},
            "all T=1 gamma=4": {"coupled_throughput_vs_optimal": 0.5},  # fixed gamma: not the basis
        }

    assert sampling_modes.verdict(groups(0.99, 0.96))["default"] == "coupled"
    assert sampling_modes.verdict(groups(0.99, 0.94))["default"] == "optimal"
    assert sampling_modes.verdict(groups(1.10, 0.951))["worst_loss"] == pytest.approx(0.049)
