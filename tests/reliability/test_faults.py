"""Faults while sessions run, with the nothing-lost check after each (in-process roles, real servers).

Real gRPC servers on 127.0.0.1, real Redis, tiny float32 Llama pair. After every
fault each session's streamed tokens must equal its committed log after the
prompt (each token once, none missing), and every greedy session must equal the
target's own ``generate()``.

* **Redis restart** (killed, back on the same port, empty): writes are paused
  first (``CLIENT PAUSE WRITE``) so the test knows exactly what was committed. Each session either finished before, or fails with
  a clean status (UNAVAILABLE / FAILED_PRECONDITION, never INTERNAL) having
  streamed a prefix of its committed log and nothing beyond it; nothing of the
  old sessions is written to the new Redis (no half-applied commit); a session
  asked for while Redis is down is refused with UNAVAILABLE; a new session
  afterwards works (the store reconnected).
* **Dropped Verify reply**: a client interceptor on the coordinator's target
  channel lets a Verify reach the target (which commits) and then raises
  UNAVAILABLE to the coordinator instead of the reply. The retry must get the
  recorded verdict back (``replayed``), identical to the dropped one, and
  nothing is streamed twice.
* **Redis stall** (``CLIENT PAUSE ALL`` for 2.5 s, data kept): sessions pause and
  resume; nothing lost or repeated.
* **Network delay to the draft**: the coordinator reaches the draft through a
  TCP proxy adding 30 ms to every chunk; generation completes with the draft
  still in use (proposals made, its breaker never opened) and the same output.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import system_fixtures as sf
from prometheus_client import REGISTRY
from pydantic import SecretStr
from reliability_helpers import Stream, assert_stream_is_log
from tcp_proxy import DelayProxy
from waiting import wait_until

from specserve.launch.redis_server import RedisServer
from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings
from specserve.runtime.store import SessionRecord, SessionStore
from specserve.v1 import target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

TEXTS = ("class Point:\n    def", "for i in range(", "def add(a, b):", "import os\nimport", "the quick brown")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(pair):
    tok = pair.tokenizer
    return [tuple(tok.encode(t, add_special_tokens=False)) for t in TEXTS]


def _target_failures() -> float:
    """Failed target calls counted against their replica (the coordinator's counter)."""
    failures = REGISTRY.get_sample_value("specserve_coordinator_replica_failures_total", {"tier": "target"})
    return failures or 0.0


def reference(pair, prompt, n):
    return sf.reference_greedy(pair.target_dir, prompt, n, ignore_eos=True)


# --------------------------------------------------------------------------- Redis restart


async def _snapshot(store: SessionStore) -> dict[str, SessionRecord]:
    """Every session's committed log in Redis, by session id."""
    return {sid: await store.load(sid) for sid in await store.session_ids()}


async def test_redis_restart_fails_sessions_cleanly_and_never_half_applies(pair, prompts, tmp_path):
    max_new = 160
    server = RedisServer(tmp_path).start()
    admin = aioredis.Redis.from_url(server.url)
    store = SessionStore.from_url(server.url)
    try:
        async with sf.local_stack(pair, server.url, coordinator_overrides={"rpc_timeout_s": 10.0}) as stack:
            streams = [
                Stream(sf.request(p, max_new_tokens=max_new, ignore_eos=True, gamma=1)) for p in prompts[:4]
            ]
            tasks = [asyncio.create_task(s.run(stack.address, timeout_s=90)) for s in streams]
            await wait_until(
                lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=60, what="3 tokens each"
            )

            await admin.execute_command("CLIENT", "PAUSE", 20000, "WRITE")  # commits wait; reads go on
            committed = await _snapshot(store)
            streamed_at_pause = [len(s.tokens) for s in streams]
            server.stop()  # killed while paused: everything is lost
            # While Redis is down a new session is refused with UNAVAILABLE, before any token.
            refused = await Stream(sf.request(prompts[4], max_new_tokens=4)).run(stack.address, timeout_s=30)
            assert refused.code == grpc.StatusCode.UNAVAILABLE and not refused.tokens, refused.details
            server.start()  # back on the same port, empty
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

            by_prompt = {c.token_ids[: c.prompt_len]: c for c in committed.values()}
            failed = 0
            for prompt, s, at_pause in zip(prompts, streams, streamed_at_pause, strict=False):
                c = by_prompt[prompt]
                log = c.generated_token_ids
                assert len(s.tokens) >= at_pause
                assert tuple(s.tokens) == log[: len(s.tokens)], (
                    "streamed a token that is not in the committed log"
                )
                assert list(log) == reference(pair, prompt, len(log)), (
                    "the committed log is not the greedy output"
                )
                if s.ok:
                    assert c.finished and tuple(s.tokens) == log
                else:
                    failed += 1
                    assert s.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION), (
                        f"{s.code}: {s.details}"
                    )
                    assert s.details, "a failed session must say why"
            assert failed >= 1, (
                "no session was still running at the restart: the test did not exercise the fault"
            )

            # Nothing of the old sessions was written to the new, empty Redis (no half-applied commit).
            for sid in committed:
                assert not await store.exists(sid)

            # The roles reconnected: a new session runs to the end and its stream is its log.
            fresh_request = sf.request(prompts[4], max_new_tokens=12, ignore_eos=True)
            fresh = await Stream(fresh_request).run(stack.address)
            assert list(await assert_stream_is_log(store, fresh)) == reference(pair, prompts[4], 12)
    finally:
        with contextlib.suppress(Exception):
            await admin.aclose()
        with contextlib.suppress(Exception):
            await store.close()
        server.stop()


# --------------------------------------------------------------------------- a proxied stack


class DropVerifyReply(grpc.aio.UnaryUnaryClientInterceptor):
    """Lets a Verify reach the target, then raises UNAVAILABLE instead of returning its reply,
    once armed; or, with ``refuse_next`` set, answers the next Verify with that status before it
    reaches the target (as a target refusing the call would); records every Verify request and
    reply that passes."""

    def __init__(self) -> None:
        self.armed = False
        self.refuse_next: grpc.StatusCode | None = None
        self.refused: list[target_pb2.VerifyRequest] = []
        self.dropped: list[tuple[target_pb2.VerifyRequest, target_pb2.VerifyResponse]] = []
        self.passed: list[tuple[target_pb2.VerifyRequest, target_pb2.VerifyResponse]] = []

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        if not (method.decode() if isinstance(method, bytes) else method).endswith("/Verify"):
            return await (await continuation(client_call_details, request))
        if self.refuse_next is not None:
            code, self.refuse_next = self.refuse_next, None
            self.refused.append(request)
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="the test refused this Verify"
            )
        call = await continuation(client_call_details, request)
        reply = await call  # the target has verified and committed by now
        if self.armed:
            self.armed = False
            self.dropped.append((request, reply))
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="the test dropped this Verify reply",
            )
        self.passed.append((request, reply))
        return reply


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def proxied(pair, redis_server):
    """Target + draft in this process, the draft behind a DelayProxy, a coordinator whose
    target channel carries :class:`DropVerifyReply`. Yields (coordinator app, proxy, dropper)."""
    from specserve.coordinator.server import start_coordinator
    from specserve.draft.server import start_draft
    from specserve.target.server import start_target

    worker = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": SecretStr(redis_server.url),
        "device": "cpu",
        "dtype": "float32",
        "warmup": False,
    }
    target = await start_target(TargetSettings(**worker, model=pair.target_dir))
    draft = await start_draft(DraftSettings(**worker, model=pair.draft_dir))
    proxy = await DelayProxy("127.0.0.1", draft.port).start()
    target_ep = f"127.0.0.1:{target.port}"
    app = await start_coordinator(
        CoordinatorSettings(
            host="127.0.0.1",
            port=0,
            redis_url=SecretStr(redis_server.url),
            target_endpoints=[target_ep],
            draft_endpoints=[proxy.address],
            tokenizer=pair.target_dir,
            rpc_timeout_s=10.0,
            keep_ended_sessions_s=600.0,  # the streams are compared with their logs afterwards
        )
    )
    dropper = DropVerifyReply()
    channel = grpc.aio.insecure_channel(target_ep, interceptors=[dropper])
    # Test-only injection: Verify calls of the coordinator go through the interceptor.
    app.coordinator.pool.target_clients[target_ep].stub = target_pb2_grpc.TargetServiceStub(channel)
    try:
        yield app, proxy, dropper
    finally:
        await app.stop(grace=0.5)
        await channel.close()
        await proxy.stop()
        await draft.stop(0.5)
        await target.stop(0.5)


def _address(app) -> str:
    return f"127.0.0.1:{app.port}"


async def test_dropped_verify_reply_is_replayed_and_nothing_is_emitted_twice(proxied, store, pair, prompts):
    app, _, dropper = proxied
    max_new = 40
    greedy = [Stream(sf.request(p, max_new_tokens=max_new, ignore_eos=True, gamma=2)) for p in prompts[:2]]
    sampled = Stream(
        sf.request(prompts[2], max_new_tokens=max_new, temperature=0.9, seed=11, ignore_eos=True, gamma=2)
    )
    streams = [*greedy, sampled]
    tasks = [asyncio.create_task(s.run(_address(app), timeout_s=90)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=60, what="3 tokens each")
    dropper.armed = True
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    assert len(dropper.dropped) == 1, "no Verify reply was dropped (sessions ended first?)"
    request, reply = dropper.dropped[0]
    for item, result in zip(request.items, reply.results, strict=True):
        assert result.WhichOneof("outcome") == "verdict", result
        # The retry of this exact (session, version) got the recorded verdict back, once.
        retries = [
            r
            for req, rep in dropper.passed
            for it, r in zip(req.items, rep.results, strict=True)
            if it.base.session_id == item.base.session_id and it.base.version == item.base.version
        ]
        assert len(retries) == 1, f"expected one retry of {item.base}, got {len(retries)}"
        assert retries[0].replayed and retries[0].verdict == result.verdict
    for s in streams:
        await assert_stream_is_log(store, s)
    for p, s in zip(prompts, greedy, strict=False):
        assert s.tokens == reference(pair, p, max_new)


async def test_resource_exhausted_is_retried_on_the_same_replica_without_opening_its_breaker(
    proxied, store, pair, prompts
):
    """A Verify answered RESOURCE_EXHAUSTED (a limit, not a broken replica) is sent again to the same
    replica: every item of the refused call is verified on the retry, the breaker stays closed, and the
    sessions finish with the target's own output."""
    app, _, dropper = proxied
    pool = app.coordinator.pool
    (target_ep,) = pool.targets.endpoints
    max_new = 24
    streams = [Stream(sf.request(p, max_new_tokens=max_new, ignore_eos=True, gamma=2)) for p in prompts[:3]]
    tasks = [asyncio.create_task(s.run(_address(app), timeout_s=90)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=60, what="3 tokens each")
    passed_before = len(dropper.passed)
    failures_before = _target_failures()
    dropper.refuse_next = grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    assert len(dropper.refused) == 1, "no Verify was refused (sessions ended first?)"
    later = [it for req, _ in dropper.passed[passed_before:] for it in req.items]
    for item in dropper.refused[0].items:
        assert any(it.base == item.base for it in later), f"{item.base} was not retried"
    assert _target_failures() == failures_before, "RESOURCE_EXHAUSTED counted against the replica"
    assert pool.targets.failures(target_ep) == 0 and pool.targets.is_up(target_ep)
    for p, s in zip(prompts, streams, strict=False):
        await assert_stream_is_log(store, s)
        assert s.tokens == reference(pair, p, max_new)


async def test_network_delay_to_the_draft_still_completes_with_the_same_output(proxied, store, pair, prompts):
    app, proxy, _ = proxied
    draft_ep = proxy.address
    pool = app.coordinator.pool
    max_new = 20
    forwarded_before = proxy.chunks_forwarded
    proxy.delay_s = 0.03
    try:
        greedy = [
            Stream(sf.request(p, max_new_tokens=max_new, ignore_eos=True, gamma=3)) for p in prompts[:3]
        ]
        sampled = Stream(
            sf.request(prompts[3], max_new_tokens=max_new, temperature=1.0, seed=5, ignore_eos=True, gamma=3)
        )
        streams = [*greedy, sampled]
        await asyncio.wait_for(
            asyncio.gather(*(s.run(_address(app), timeout_s=120) for s in streams)), timeout=150
        )
    finally:
        proxy.delay_s = 0.0
    for s in streams:
        await assert_stream_is_log(store, s)
        assert s.stats.proposed_tokens > 0, "the draft was not used through the delayed link"
    for p, s in zip(prompts, greedy, strict=False):
        assert s.tokens == reference(pair, p, max_new)
    assert proxy.chunks_forwarded > forwarded_before
    assert pool.drafts.failures(draft_ep) == 0 and pool.drafts.is_up(draft_ep), (
        "the delay opened the draft's breaker"
    )


async def test_redis_stall_pauses_sessions_which_then_resume(proxied, store, redis_server, pair, prompts):
    """Redis answers nothing for 2.5 s (``CLIENT PAUSE ALL``, shorter than the clients' 5 s socket
    timeout): sessions wait and then resume, losing and repeating nothing."""
    app, _, _ = proxied
    max_new = 40
    greedy = [Stream(sf.request(p, max_new_tokens=max_new, ignore_eos=True, gamma=2)) for p in prompts[:3]]
    sampled = Stream(
        sf.request(prompts[3], max_new_tokens=max_new, temperature=1.0, seed=9, ignore_eos=True, gamma=2)
    )
    streams = [*greedy, sampled]
    tasks = [asyncio.create_task(s.run(_address(app), timeout_s=90)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=60, what="3 tokens each")
    async with aioredis.Redis.from_url(redis_server.url) as admin:
        await admin.execute_command("CLIENT", "PAUSE", 2500, "ALL")
    at_pause = [len(s.tokens) for s in streams]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    assert any(n < max_new for n in at_pause), "every session had finished before the stall"
    for s in streams:
        await assert_stream_is_log(store, s)
    for p, s in zip(prompts, greedy, strict=False):
        assert s.tokens == reference(pair, p, max_new)
