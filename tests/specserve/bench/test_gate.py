"""specserve bench gate: the ratios per (prompt, pass) pair, the A/A control, the bars met and missed, the report
and the history it appends to; and a whole run on the tiny pair through a real stack."""

from __future__ import annotations

import json

import pytest
import system_fixtures as sf

from specserve.bench import gate
from specserve.bench.cli import main
from specserve.bench.options import GateOptions


def _gens(kind: str, ms: dict[str, list[float]], tokens: int = 10) -> list[gate.Generation]:
    """One generation per (mode, pass): ``ms[mode][repeat]`` ms per token, the same tokens everywhere."""
    out = []
    for mode, per_repeat in ms.items():
        for repeat, ms_per_token in enumerate(per_repeat):
            out.append(gate.Generation(kind, "p0", repeat, mode, tokens, ms_per_token * tokens / 1e3, [1] * tokens))
    return out


@pytest.mark.unit
def test_ratios_are_taken_within_each_turn_and_the_bars_are_checked():
    gens = _gens("chat", {
        gate.HF: [40.0, 80.0],  # the second pass ran on a machine twice as slow: every mode with it
        gate.HF_AGAIN: [42.0, 80.0],
        gate.HF_ASSISTED: [40.0, 80.0],
        gate.GAMMA_0: [36.0, 72.0],
        gate.DEFAULT: [32.0, 64.0],
    }) + _gens("translate", {gate.HF: [40.0], gate.GAMMA_0: [40.0], gate.DEFAULT: [44.0]})
    summary = gate.summarize(gens, ["chat", "translate"])
    chat = summary["table"]["chat"]
    assert chat[gate.DEFAULT]["vs_hf"]["median"] == pytest.approx(1.25)  # 40/32 and 80/64: the pairs, not the medians
    assert chat[gate.GAMMA_0]["vs_hf"]["min"] == pytest.approx(40 / 36)
    assert chat[gate.HF_AGAIN]["vs_hf"]["min"] == pytest.approx(40 / 42)  # the A/A control
    assert chat[gate.DEFAULT]["vs_gamma0"]["median"] == pytest.approx(36 / 32)
    bars = {(b["bar"], b["kind"]): b for b in summary["bars"]}
    assert bars[(gate.BARS[0].label(), "chat")]["met"]  # gamma 0 >= 1.0x HF
    assert bars[(gate.BARS[1].label(), "chat")]["met"]  # the default 1.25x >= 1.15x on chat
    assert bars[(gate.BARS[3].label(), "chat")]["met"]  # 1.25x HF assisted
    missed = bars[(gate.BARS[4].label(), "translate")]  # the default at 40/44 of gamma 0 on translate
    assert not missed["met"] and missed["measured"] == pytest.approx(40 / 44)
    assert all(b["kind"] != "chat-code" for b in summary["bars"])  # code was not measured: no bar claimed for it
    assert summary["greedy_identity"][gate.DEFAULT] == {"identical": 3, "of": 3}


@pytest.mark.unit
def test_the_report_names_the_cpu_the_command_and_every_bar():
    gens = _gens("chat", {gate.HF: [40.0], gate.HF_AGAIN: [40.0], gate.GAMMA_0: [50.0], gate.DEFAULT: [30.0]})
    data = {
        "command": "specserve bench gate --kinds chat",
        "date_utc": "2026-12-06 18:00",
        "cpu_kind": {"cpu": "Test CPU 9000", "flags": ["avx2"], "cores": 2, "torch": "2.13.0"},
        "settings": {"max_new_tokens": 64, "repeats": 1},
        "llama_cpp": "not installed (pip install llama-cpp-python)",
        "load_average": {"before": [0.5, 0, 0], "after": [1.0, 0, 0]},
        "summary": gate.summarize(gens, ["chat"]),
    }
    text = gate.render(data)
    assert "Test CPU 9000" in text and "specserve bench gate --kinds chat" in text
    assert "| specserve gamma 0 | 50.0 (0.80x, 0.80-0.80) |" in text
    assert "**missed**: specserve gamma 0 >= 1.00x HF generate() on chat and code (chat: 0.80x)" in text
    assert "met: specserve default request >= 1.15x HF generate() on chat (chat: 1.33x)" in text
    assert "llama.cpp: not installed" in text


@pytest.mark.unit
def test_settings_are_given_per_role_and_checked():
    opts = GateOptions(setting=["target.invariant=true", "target.dtype=bfloat16", "draft.threads=1"])
    assert opts.overrides() == {
        "target": {"invariant": True, "dtype": "bfloat16"}, "draft": {"threads": "1"}, "coordinator": {}
    }
    with pytest.raises(ValueError, match=r"ROLE\.KEY=VALUE"):
        GateOptions(setting=["invariant=true"])


@pytest.mark.system
def test_the_gate_runs_on_the_tiny_pair_and_appends_to_the_history(tmp_path_factory, tmp_path):
    pair = sf.tiny_pair(tmp_path_factory)
    history = tmp_path / "history.md"
    history.write_text("# History\n")
    argv = [
        "gate", "--target", str(pair.target_dir), "--draft", str(pair.draft_dir), "--kinds", "chat", "arithmetic",
        "--prompts", "1", "--task-prompts", "1", "--repeats", "2", "--max-new-tokens", "6", "--llama-cpp", "off",
        "--out", str(tmp_path), "--history", str(history),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "gate.json").read_text())
    modes = {g["mode"] for g in data["generations"]}
    assert modes == {gate.HF, gate.HF_AGAIN, gate.HF_ASSISTED, gate.GAMMA_0, gate.DEFAULT}
    assert len(data["generations"]) == 2 * 2 * 5  # two kinds, two passes, five modes
    assert all(g["tokens"] == 6 for g in data["generations"])
    # Every specserve generation prefilled its whole prompt, as HF does: none found another's in the prefix cache.
    served = [g for g in data["generations"] if g["mode"] in (gate.GAMMA_0, gate.DEFAULT)]
    assert len(served) == 8 and all(g["cached_tokens"] == 0 for g in served)
    assert set(data["summary"]["table"]) == {"chat", "arithmetic"}
    # Greedy through the stack is the target's own greedy output (the tiny target's logits are spread wide).
    ident = data["summary"]["greedy_identity"]
    assert ident[gate.GAMMA_0] == {"identical": 4, "of": 4} and ident[gate.DEFAULT] == {"identical": 4, "of": 4}
    text = history.read_text()
    assert text.startswith("# History\n") and "### Speed gate" in text and data["cpu_kind"]["cpu"] in text
    assert (tmp_path / "gate.md").read_text().count("Bars:") == 1
    # The kernel paths the stack's workers recorded for this kind of machine (the target's and the draft's).
    assert {k["role"] for k in data["kernels"]} <= {"target", "draft"}
    assert all(k["kernels"] in ("stock", "onednn") for k in data["kernels"])
    assert "Kernel paths the stack's workers run" in text
