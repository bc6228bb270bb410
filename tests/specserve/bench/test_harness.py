"""specserve.bench.harness: the full single-stream + load run on the tiny pair, end to end through
``specserve bench all`` (``specserve.bench.cli.main``) (a real local stack and Redis): every mode measured on every prompt set,
greedy output identical to HF target-only, and the report rendered with its targets."""

from __future__ import annotations

import asyncio
import json

import pytest
import system_fixtures as sf
import torch

from specserve.bench.cli import main
from specserve.bench.modes import HEAD_MODES, HF_LOOKUP, HF_STOCK, SPEC_MODES
from specserve.engine import attention, cpu_kernels
from specserve.prompts.chat import copy_prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.mark.unit
def test_copy_prompts_quote_real_code_and_ask_for_it_back():
    prompts = copy_prompts()
    assert len(prompts) >= 4
    for p in prompts:
        assert "```python\ndef " in p.text and p.kind == "copy"


async def test_a_full_run_measures_every_mode_and_greedy_output_is_the_targets(pair, redis_server, tmp_path):
    argv = [
        "all",
        "--target", str(pair.target_dir),
        "--draft", str(pair.draft_dir),
        "--redis-url", redis_server.url,
        "--out", str(tmp_path),
        "--prompt-sets", "chat", "copy",
        "--prompts", "1",
        "--max-new-tokens", "12",
        "--single-repeats", "2",
        "--temperatures", "0", "0.7",
        "--rates", "4",
        "--load-duration-s", "0.5",
        "--load-max-new-tokens", "6",
        "--load-repeats", "2",
        "--cost-repeats", "2",
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    # The target's packed oneDNN kernels where this PyTorch has them (the HF baselines alike), and HF
    # target-only with the stock kernels beside them.
    # The harness's default, "auto", as the target's: packed where this PyTorch has oneDNN.
    assert data["kernels"] == cpu_kernels.resolve("auto", torch.device("cpu"), torch.float32)
    stock = [HF_STOCK] if data["kernels"] == "onednn" else []
    served = [m.name for m in SPEC_MODES if m.name not in HEAD_MODES]  # the tiny pair has no feature head
    modes = ["hf target-only", *stock, "hf assisted", *HF_LOOKUP, *served]
    assert sorted(data["single_stream"]) == ["chat T=0", "chat T=0.7", "copy T=0", "copy T=0.7"]
    for group in data["single_stream"].values():
        assert list(group) == modes
    assert all(r["tokens"] == 12 for r in data["runs"])
    # Two passes over the prompts, the second with the modes in the reverse order; the medians take both.
    for repeat, order in ((0, modes), (1, modes[::-1])):
        turn = [r for r in data["runs"] if r["repeat"] == repeat][: len(modes)]
        assert [r["mode"] for r in turn] == order
        assert {(r["prompt_set"], r["temperature"]) for r in turn} == {("chat", 0.0)}
    assert len(data["runs"]) == 2 * 4 * len(modes)
    identity = data["greedy_identity"]
    assert identity["total"] == 2 * 2 * len(served) and identity["identical"] == identity["total"]
    if stock:
        assert identity["identical_to_stock_kernels"] == identity["total"]
    assert {p["mode"] for p in data["load"]} >= {"specserve gamma=0", "specserve adaptive"}
    # Every point twice, interleaved: the second repeat starts the rate from another mode.
    assert sorted(p["repeat"] for p in data["load"]) == [0, 0, 0, 1, 1, 1]
    assert [p["mode"] for p in data["load"][:3]] != [p["mode"] for p in data["load"][3:]]
    # The target runs in its own process: its work is read from its /metrics endpoint.
    for point in data["load"]:
        if point["committed_tokens"]:
            assert (
                point["target_positions"] >= point["committed_tokens"] and point["target_forward_passes"] > 0
            )
    report = (tmp_path / "README.md").read_text()
    assert "## Targets" in report and "copy T=0" in report
    assert "over prompts and 2 passes over them" in report
    # The tiny target has grouped-query attention: its passes, the service's and the HF baselines', read the
    # grouped heads in place (specserve.engine.attention), and the report says so.
    assert data["attention"] == attention.ATTENTION
    assert "reads the grouped key/value heads in place" in report


async def test_a_load_only_run_writes_load_json_and_the_report_takes_its_sweep(
    pair, redis_server, tmp_path, tmp_path_factory
):
    """With a feature head served (``--head``), the sweep runs it too, and its points carry the feature bytes
    the coordinator relayed, read from the coordinator's own ``/metrics`` (a process of its own)."""
    head_dir = sf.tiny_head(pair, tmp_path_factory, [[5, 17, 33, 2]], length=8, steps=5)
    argv = [
        "load",
        "--target", str(pair.target_dir),
        "--draft", str(pair.draft_dir),
        "--head", str(head_dir),
        "--redis-url", redis_server.url,
        "--out", str(tmp_path),
        "--prompt-sets", "chat",
        "--prompts", "1",
        "--rates", "2", "4",
        "--duration-s", "0.5",
        "--max-new-tokens", "4",
        "--fixed-gamma", "2",
        "--head-gamma", "3",
        "--name", "load_head",
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    run = json.loads((tmp_path / "load_head.json").read_text())
    assert run["command"].startswith("specserve bench load ") and run["prompt_set"] == "chat"
    modes = ("specserve gamma=0", "specserve gamma=2", "specserve adaptive", "specserve feature gamma=3")
    assert {(p["rate_rps"], p["mode"]) for p in run["load"]} == {(rate, m) for rate in (2.0, 4.0) for m in modes}
    assert all(p["errors"] == 0 and p["completed"] == p["requests"] for p in run["load"])
    row = 2 * json.loads((head_dir / "config.json").read_text())["hidden_size"]
    assert run["head"]["hidden"] * 2 == row and run["head"]["head_over_target_step"] is None  # no card beside it
    for p in run["load"]:
        relayed = p["feature_bytes_to_draft"]
        if p["mode"].startswith("specserve feature") and p["completed"]:
            assert relayed > 0 and relayed % row == 0 and p["draft_rounds"] > 0, p
        else:
            assert relayed == 0, p  # the token draft's modes relay nothing
    text = (tmp_path / "load_head.md").read_text()
    assert "specserve bench load " in text and "| specserve feature gamma=3 |" in text
    assert "Projections, not measurements" in text
