"""Faults through the whole system (real Redis, real gRPC servers on loopback, tiny float32 models).

* A target replica stops in the middle of a greedy generation: the session moves
  to the other replica (which rebuilds it from Redis) and finishes with the same
  greedy output, each token streamed once.
* The draft service stops: generation continues at gamma = 0 and finishes with
  the same greedy output; later sessions run without a draft.
* The draft is slow (behind a delaying link): its deadline expires, the round
  runs at gamma = 0, same greedy output.
* A client cancels: the session's caches are released on the draft and the
  target, its lease is dropped, and it commits nothing more.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import system_fixtures as sf
from waiting import wait_until

from specserve.runtime.config import CoordinatorSettings
from specserve.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_NEW = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt(pair):
    return pair.tokenizer.encode("class Point:\n    def", add_special_tokens=False)


@pytest.fixture(scope="module")
def expected(pair, prompt):
    return sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)


async def _stream(stack, req):
    """Open a Generate stream; returns (channel, call)."""
    channel = grpc.aio.insecure_channel(stack.address)
    call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(req, timeout=120)
    return channel, call


async def _drain(call, received: list[int]):
    stats = None
    while True:
        reply = await call.read()
        if reply is grpc.aio.EOF:
            break
        if reply.WhichOneof("event") == "chunk":
            received.extend(reply.chunk.token_ids)
        else:
            stats = reply.stats
    return stats


def _holder(stack, before: list[set[str]]) -> tuple[int, str]:
    """The target replica holding the one new session, and its id."""
    found = [(i, sid) for i, t in enumerate(stack.targets) for sid in set(t.caches.session_ids()) - before[i]]
    assert len(found) == 1, f"expected one new session on one replica, found {found}"
    return found[0]


async def test_target_failover_mid_generation_keeps_greedy_output(
    pair, redis_server, store, prompt, expected
):
    async with sf.local_stack(pair, redis_server.url, n_targets=2) as stack:
        before = [set(t.caches.session_ids()) for t in stack.targets]
        channel, call = await _stream(
            stack, sf.request(prompt, max_new_tokens=MAX_NEW, gamma=1, ignore_eos=True)
        )
        received: list[int] = []
        async with channel:
            first = await call.read()
            received.extend(first.chunk.token_ids)
            victim, sid = _holder(stack, before)
            await stack.stop_target(victim)
            n_before_stop = len(received)
            stats = await _drain(call, received)
        assert n_before_stop < MAX_NEW, "the replica must stop in the middle of the generation"
        assert received == expected
        assert stats.completion_tokens == MAX_NEW and stats.session_id == sid
        record = await store.load(sid)
        assert list(record.generated_token_ids) == received
        pool = stack.coordinator.coordinator.pool
        victim_ep = f"127.0.0.1:{stack.target_ports[victim]}"
        assert pool.targets.failures(victim_ep) >= 1
        # Later sessions are served by the surviving replica.
        again = await sf.generate(
            stack.address, sf.request(prompt, max_new_tokens=16, gamma=2, ignore_eos=True)
        )
        assert again.token_ids == expected[:16]


async def test_draft_down_continues_at_gamma_zero(pair, redis_server, store, prompt, expected):
    async with sf.local_stack(pair, redis_server.url) as stack:
        channel, call = await _stream(
            stack, sf.request(prompt, max_new_tokens=MAX_NEW, gamma=2, ignore_eos=True)
        )
        received: list[int] = []
        async with channel:
            first = await call.read()
            received.extend(first.chunk.token_ids)
            await stack.stop_draft()
            stats = await _drain(call, received)
        assert received == expected
        assert stats.proposed_tokens < 2 * stats.rounds, (
            "rounds after the draft stopped must run at gamma = 0"
        )
        record = await store.load(stats.session_id)
        assert list(record.generated_token_ids) == received
        # A new session with the draft gone still finishes, every round at gamma = 0 (after the first token,
        # decode_steps target steps per round).
        later = await sf.generate(
            stack.address, sf.request(prompt, max_new_tokens=24, gamma=4, ignore_eos=True)
        )
        assert later.token_ids == expected[:24]
        steps = CoordinatorSettings.model_fields["decode_steps"].default
        assert later.stats.proposed_tokens == 0 and later.stats.rounds == 1 + -(-23 // steps)


async def test_cancellation_releases_caches_on_both_workers(pair, redis_server, store, prompt):
    async with sf.local_stack(pair, redis_server.url) as stack:
        before = [set(stack.targets[0].caches.session_ids())]
        channel, call = await _stream(stack, sf.request(prompt, max_new_tokens=400, gamma=2, ignore_eos=True))
        async with channel:
            await call.read()
            await call.read()
            _, sid = _holder(stack, before)
            assert sid in stack.draft.caches, "the draft must hold the session while it runs"
            call.cancel()
        # Clean-up runs in the background: wait (bounded) for both workers to drop the session.
        await wait_until(
            lambda: sid not in stack.targets[0].caches and sid not in stack.draft.caches,
            timeout_s=10,
            what="both workers to drop the session",
        )
        assert sid not in stack.draft.engine.history
        await stack.coordinator.coordinator.drain()
        assert await store.lease_owner(sid) is None
        record = await store.load(sid)
        assert not record.finished and record.committed_len - record.prompt_len < 400
        await asyncio.sleep(0.3)
        assert (await store.load(sid)).version == record.version, "a cancelled session must stop committing"
        assert stack.coordinator.coordinator.active_sessions == 0


async def test_slow_draft_hits_its_deadline_and_the_round_runs_at_gamma_zero(
    pair, redis_server, prompt, expected
):
    """The draft is reachable only through a link adding 5 s per chunk; with a 2 s deadline the
    Propose call fails with DEADLINE_EXCEEDED, the draft's breaker opens, and the session
    finishes at gamma = 0 with the target's greedy output."""
    from tcp_proxy import DelayProxy

    from specserve.coordinator.server import start_coordinator
    from specserve.runtime.config import CoordinatorSettings

    async with sf.local_stack(pair, redis_server.url) as stack:
        proxy = await DelayProxy("127.0.0.1", stack.draft_port, delay_s=0.0).start()
        settings = CoordinatorSettings(
            host="127.0.0.1",
            port=0,
            redis_url=redis_server.url,
            target_endpoints=[f"127.0.0.1:{p}" for p in stack.target_ports],
            draft_endpoints=[proxy.address],
            draft_timeout_s=2.0,
        )
        app = await start_coordinator(settings, tokenizer=pair.tokenizer)
        try:
            proxy.delay_s = 5.0
            out = await sf.generate(
                f"127.0.0.1:{app.port}", sf.request(prompt, max_new_tokens=8, gamma=2, ignore_eos=True)
            )
            assert out.token_ids == expected[:8]
            assert out.stats.proposed_tokens == 0
            # It did wait for the draft, up to the Propose deadline (not the 30 s rpc_timeout_s).
            assert 2e9 <= out.stats.draft_ns < 10e9
            assert app.coordinator.pool.drafts.failures(proxy.address) >= 1
        finally:
            await app.stop(0.5)
            await proxy.stop()
