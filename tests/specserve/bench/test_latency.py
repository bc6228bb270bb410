"""specserve.bench.latency: the order-preserving delay proxy, and the latency mode of the harness on the tiny
pair end to end through ``specserve bench latency`` (``specserve.bench.cli.main``) (a real local stack and Redis)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import system_fixtures as sf

from specserve.bench.cli import main
from specserve.bench.latency import LatencyProxy, section, won_back


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.mark.system
async def test_the_proxy_delays_each_way_and_keeps_the_order():
    """Chunks come back in order, each way at least the delay after it was sent (the proxy never delivers
    early). How little beyond that, chunks in flight not queueing behind each other's delays, is a speed:
    the latency mode of the benchmark measures what a delay adds (docs/benchmarks/latency_draft.md)."""

    async def echo(reader, writer):
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = await LatencyProxy(f"127.0.0.1:{port}", 0.05).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        start = time.perf_counter()
        for i in range(5):
            writer.write(bytes([i]))
            await writer.drain()
            await asyncio.sleep(0.002)
        got = b""
        while len(got) < 5:
            got += await asyncio.wait_for(reader.read(100), 5)
        elapsed = time.perf_counter() - start
        assert got == bytes(range(5))  # in order
        assert elapsed >= 0.1  # one round trip: 50 ms each way
        writer.close()
    finally:
        await proxy.stop()
        server.close()


async def test_the_mode_runs_through_the_harness_and_greedy_output_never_changes(
    pair, redis_server, tmp_path, capsys
):
    argv = [
        "latency",
        "--target", str(pair.target_dir),
        "--draft", str(pair.draft_dir),
        "--redis-url", redis_server.url,
        "--out", str(tmp_path),
        "--prompt-sets", "chat",
        "--rtts-ms", "0", "4",
        "--prompts", "1",
        "--max-new-tokens", "10",
        "--repeats", "2",
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    data = json.loads((tmp_path / "latency.json").read_text())
    rows = data["summary"]
    assert {(r["side"], r["rtt_ms"]) for r in rows} == {(s, t) for s in ("draft", "target") for t in (0.0, 4.0)}
    assert {r["mode"] for r in rows} == {"gamma=0", "gamma=1", "adaptive", "gamma=1 +overlap", "adaptive +overlap"}
    # The tiny draft serves no feature head: its mode is left out, and the run says why.
    assert "the feature head's mode is left out" in capsys.readouterr().out
    assert data["settings"]["head"] is None and all(r["head"] is None for r in rows)
    assert all(r["n"] == 2 for r in rows), "each setting ran the prompt once per repeat"
    # Tiers on cores of their own where there are two: the draft and the coordinator share the first.
    cpus = data["settings"]["cpus"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus["draft"] == cpus["coordinator"] and not set(cpus["draft"]) & set(cpus["target"])
    else:
        assert cpus is None
    assert all(r["identical"] for r in rows), "latency never changes greedy output"
    assert all(run["tokens"] == 10 for run in data["runs"])
    slowed = [r for r in rows if r["side"] == "target" and r["rtt_ms"] == 4.0]
    assert all(r["added_ms_per_token"] is not None for r in slowed)
    # Overlap's drafts ahead are counted from the coordinator process's metrics: every round of a fixed
    # gamma drafts ahead; without overlap none does.
    for r in rows:
        ahead = r["ahead_used"] + r["ahead_wasted"]
        assert (ahead > 0) if r["mode"] == "gamma=1 +overlap" else (ahead == 0 or "+overlap" in r["mode"]), r
    # The rounds' wait on the draft tier: none at gamma 0 (no Propose call), some wherever a round drafts.
    for r in rows:
        if r["mode"] == "gamma=0":
            assert r["draft_wait_ms_per_token"] == 0.0, r
        elif r["mode"].startswith("gamma=1"):
            assert r["draft_wait_ms_per_token"] > 0.0, r
    assert "drafted ahead, used" in (tmp_path / "latency.md").read_text()
    assert "Network latency" in (tmp_path / "latency.md").read_text()


@pytest.mark.unit
def test_won_back_is_measured_end_to_end_and_on_the_draft_wait_behind_a_delayed_draft():
    def row(side, rtt, mode, ms, wait):
        return {
            "side": side,
            "rtt_ms": rtt,
            "mode": mode,
            "ms_per_token": ms,
            "draft_wait_ms_per_token": wait,
            "added_ms_per_token": None,
            "tokens_per_round": None,
            "acceptance": 0.0,
            "identical": True,
        }

    summary = [
        row("draft", 0.0, "gamma=1", 50.0, 6.0),
        row("draft", 0.0, "gamma=1 +overlap", 51.0, 4.0),
        row("draft", 10.0, "gamma=1", 58.0, 12.0),
        row("draft", 10.0, "gamma=1 +overlap", 57.0, 8.0),
        row("target", 0.0, "gamma=1", 50.0, 6.0),
        row("target", 0.0, "gamma=1 +overlap", 50.0, 4.0),
        row("target", 10.0, "gamma=1", 55.0, 6.0),
        row("target", 10.0, "gamma=1 +overlap", 54.0, 4.0),
    ]
    won = {(w["side"], w["rtt_ms"]): w for w in won_back(summary)}
    assert set(won) == {("draft", 10.0), ("target", 10.0)}
    draft = won[("draft", 10.0)]
    assert draft["cost_ms"] == pytest.approx(8.0) and draft["won_back"] == pytest.approx(1 / 8)
    assert draft["draft_wait"]["cost_ms"] == pytest.approx(6.0)
    assert draft["draft_wait"]["won_back"] == pytest.approx(4 / 6)
    # Behind a delayed target the draft's wait is not where the RTT lands: no figure for it.
    assert won[("target", 10.0)]["draft_wait"] is None
    lines = "\n".join(section({"settings": {"max_new_tokens": 8, "prompts": 1, "command": "x"}, "summary": summary}))
    assert "| draft | 10 | gamma=1 | +8.00 | 12% | +6.00 | 67% |" in lines
    assert "| target | 10 | gamma=1 | +5.00 | 20% | - | - |" in lines


@pytest.mark.unit
def test_the_report_renders_every_latency_run_kept_beside_latency_json(tmp_path):
    from specserve.bench.report import latency_files, write_latency

    for name, tier in (("latency_draft", "draft"), ("latency", "target")):
        data = {
            "settings": {"max_new_tokens": 8, "prompts": 1, "command": f"run {name}"},
            "summary": [
                {
                    "side": tier,
                    "rtt_ms": 0.0,
                    "mode": "gamma=1",
                    "ms_per_token": 50.0,
                    "added_ms_per_token": 0.0,
                    "tokens_per_round": 1.5,
                    "acceptance": 0.5,
                    "identical": True,
                }
            ],
        }
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    files = latency_files(tmp_path)
    assert [f.name for f in files] == ["latency.json", "latency_draft.json"]
    for f in files:
        write_latency(json.loads(f.read_text()), tmp_path, f.stem)
    assert "run latency_draft" in (tmp_path / "latency_draft.md").read_text()
    assert "| target | 0 | gamma=1 | 50.00 | +0.00 | - |" in (tmp_path / "latency.md").read_text()
