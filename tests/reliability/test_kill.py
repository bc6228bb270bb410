"""``kill -9`` of worker processes mid-generation (each worker is its own ``specserve serve`` process).

Two target processes and one draft process run ``specserve serve ROLE``
(``specserve.launch.cli.main``) on free loopback ports, forked from one launcher that
imported the stack once (``role_zygote.py``: start-up in seconds, not a torch
import per process) (tiny float32
Llama pair, the session's real Redis); the coordinator runs in the test process
so the test can see which replica each session is bound to.

* One of two targets hangs (SIGSTOP): after the coordinator's deadline on a
  Verify to it, its sessions move to the other replica and finish unchanged.
* One of two targets is killed with SIGKILL while sessions stream, at a moment
  when the other's circuit breaker is still open from earlier failures (8-10 s
  back-off): the sessions wait for it, move to it, it rebuilds them from Redis,
  and they finish with the target's own greedy output.
* The draft is killed with SIGKILL while sessions stream: they continue at
  gamma = 0 and finish with the same greedy output; a later session runs
  without any proposals.

After each: every stream equals its committed log after the prompt (each token
once), every greedy stream equals ``generate()`` of the target alone. The kills
of a target and of the draft also run sampled sessions in the coupled mode
alongside: those equal the target's own Gumbel-max sampling with their seed
(``system_fixtures.reference_coupled``), failover and dead draft
notwithstanding.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from reliability_helpers import (
    Stream,
    assert_stream_is_log,
    fork_roles,
    role_starter,
    start_role,
    start_test_coordinator,
    two_targets_and_a_draft,
    wait_serving,
)
from waiting import wait_until

from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = ("class Point:\n    def", "for i in range(", "def add(a, b):", "import os\nimport", "the quick brown")
MAX_NEW = 96
RPC_TIMEOUT_S = 3.0  # the coordinator's deadline on worker calls: a hung replica is left after it


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(pair):
    return [tuple(pair.tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]


@pytest.fixture(scope="module")
def workers(request, pair, redis_server, tmp_path_factory):
    """{"targets": [RoleProcess, RoleProcess], "draft": RoleProcess}: ``specserve serve`` processes,
    forked from the pre-imported launcher (``role_launcher``), or with
    ``SPECSERVE_TEST_FORK_ROLES=0`` started as ``python -m specserve.launch.cli serve ...`` each."""
    with two_targets_and_a_draft(role_starter(request, tmp_path_factory), pair, redis_server.url) as roles:
        yield roles


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def coordinator(workers, pair, redis_server):
    app = await start_test_coordinator(
        pair.target_dir,
        redis_server.url,
        targets=[t.address for t in workers["targets"]],
        drafts=[workers["draft"].address],
        rpc_timeout_s=RPC_TIMEOUT_S,
    )
    yield app
    await app.stop(grace=1.0)


def reference(pair, prompt, n):
    return sf.reference_greedy(pair.target_dir, prompt, n, ignore_eos=True)


def coupled_request(prompt, seed, *, max_new_tokens, gamma):
    return sf.request(
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=seed,
        ignore_eos=True,
        gamma=gamma,
        sampling_mode=common_pb2.SAMPLING_MODE_COUPLED,
    )


async def test_a_hung_target_is_left_after_the_deadline(coordinator, workers, store, pair, prompts):
    """SIGSTOP (a replica that hangs, neither answering nor refusing): once a Verify to it
    passes its deadline the sessions bound to it move to the other replica and finish
    with the same output; the hung replica's late commits, if any, change nothing."""
    address = f"127.0.0.1:{coordinator.port}"
    pool = coordinator.coordinator.pool
    max_new = 48
    streams = [Stream(sf.request(p, max_new_tokens=max_new, ignore_eos=True, gamma=2)) for p in prompts[:4]]
    tasks = [asyncio.create_task(s.run(address, timeout_s=120)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=90, what="3 tokens each")
    assigned = pool.bound_targets()
    by_endpoint = {
        t.address: [sid for sid, ep in assigned.items() if ep == t.address] for t in workers["targets"]
    }
    victim = max(workers["targets"], key=lambda t: len(by_endpoint[t.address]))
    at_stop = {id(s): len(s.tokens) for s in streams}
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=100)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    for prompt, s in zip(prompts, streams, strict=False):
        await assert_stream_is_log(store, s)
        assert s.tokens == reference(pair, prompt, max_new)
    moved = [s for s in streams if s.session_id in by_endpoint[victim.address]]
    assert any(at_stop[id(s)] < max_new for s in moved), "no session was mid-generation on the hung target"
    assert pool.targets.failures(victim.address) >= 1 or not pool.targets.is_up(victim.address)


async def test_kill_9_of_one_target_moves_its_sessions_to_the_other(
    coordinator, workers, store, pair, prompts
):
    address = f"127.0.0.1:{coordinator.port}"
    pool = coordinator.coordinator.pool
    greedy = [Stream(sf.request(p, max_new_tokens=MAX_NEW, ignore_eos=True, gamma=2)) for p in prompts]
    coupled = [
        Stream(coupled_request(p, 50 + i, max_new_tokens=MAX_NEW, gamma=2)) for i, p in enumerate(prompts)
    ]
    streams = [*greedy, *coupled]
    tasks = [asyncio.create_task(s.run(address, timeout_s=120)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=90, what="3 tokens each")

    # Kill the replica holding most coupled sessions now (the coordinator's routing table says which).
    assigned = pool.bound_targets()  # session id -> target endpoint, for sessions in a round
    by_endpoint = {
        t.address: [sid for sid, ep in assigned.items() if ep == t.address] for t in workers["targets"]
    }
    modes = {sid: (await store.load(sid)).sampling.sampling_mode for sid in assigned}  # from the Redis log
    victim = max(
        workers["targets"],
        key=lambda t: (
            sum(modes[sid] == "coupled" for sid in by_endpoint[t.address]),
            len(by_endpoint[t.address]),
        ),
    )
    (survivor,) = [t for t in workers["targets"] if t is not victim]
    # The survivor failed recently and has recovered, but its breaker is still open for 8-10 s:
    # the sessions must wait for it rather than give up while every replica is backing off.
    backoff = max(pool.targets.mark_failed(survivor.address) for _ in range(5))
    assert backoff >= 8.0
    victim.kill()
    at_kill = {id(s): len(s.tokens) for s in streams}
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    for prompt, s in zip(prompts, greedy, strict=True):
        await assert_stream_is_log(store, s)
        assert s.tokens == reference(pair, prompt, MAX_NEW)
    for i, (prompt, s) in enumerate(zip(prompts, coupled, strict=True)):
        await assert_stream_is_log(store, s)
        assert s.tokens == sf.reference_coupled(pair.target_dir, prompt, MAX_NEW, seed=50 + i)
    moved = [s for s in streams if s.session_id in by_endpoint[victim.address]]
    assert any(at_kill[id(s)] < MAX_NEW for s in moved), "no session was mid-generation on the killed target"
    moved_coupled = [s for s in coupled if s.session_id in by_endpoint[victim.address]]
    assert any(at_kill[id(s)] < MAX_NEW for s in moved_coupled), (
        "no coupled session failed over mid-generation"
    )
    assert pool.targets.failures(victim.address) >= 1 or not pool.targets.is_up(victim.address)


async def test_kill_9_of_the_coordinator_ends_its_streams_with_unavailable_and_leaves_the_logs(
    request, workers, store, pair, prompts, redis_server, tmp_path_factory
):
    """A coordinator process (``specserve serve coordinator``) killed with SIGKILL mid-generation: its
    clients' streams end with UNAVAILABLE having received a prefix of their session's committed log; the
    logs stay in Redis, unfinished; the owner leases lapse after ``lease_ttl_s``; the SDK raises
    Unavailable for a stream that had tokens (it never resends one, see test_client.py)."""
    from specserve.api import errors
    from specserve.client import AsyncClient

    start = request.getfixturevalue("role_launcher").start if fork_roles() else None
    if start is None:
        log_dir = tmp_path_factory.mktemp("coordinator-logs")

        def start(role, flags):
            return start_role(role, flags, log_dir=log_dir)

    lease_ttl_s = 6.0  # renewed every 2 s while rounds run: after the kill, 4 to 6 s are left
    flags = {
        "redis_url": redis_server.url,
        "target_endpoints": [t.address for t in workers["targets"]],
        "draft_endpoints": [workers["draft"].address],
        "tokenizer": str(pair.target_dir),
        "lease_ttl_s": lease_ttl_s,
        "rpc_timeout_s": RPC_TIMEOUT_S,
        "log_level": "warning",
    }
    before = set(await store.session_ids())
    process = start("coordinator", flags)
    try:
        wait_serving([process], timeout_s=240)
        streams = [Stream(sf.request(p, max_new_tokens=MAX_NEW, ignore_eos=True, gamma=2)) for p in prompts[:3]]
        tasks = [asyncio.create_task(s.run(process.address, timeout_s=60)) for s in streams]
        async with AsyncClient(process.address, retries=3) as client:
            sdk_stream = client.stream(prompt_token_ids=prompts[3], max_new_tokens=MAX_NEW, ignore_eos=True)
            sdk_tokens: list[int] = []

            async def sdk() -> BaseException | None:
                try:
                    async with sdk_stream as chunks:
                        async for chunk in chunks:
                            sdk_tokens.extend(chunk.token_ids)
                except errors.SpecServeError as exc:
                    return exc
                return None

            sdk_task = asyncio.create_task(sdk())
            await wait_until(
                lambda: all(len(s.tokens) >= 3 for s in streams) and len(sdk_tokens) >= 3,
                timeout_s=90,
                what="3 tokens each",
            )
            process.kill()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            sdk_error = await asyncio.wait_for(sdk_task, timeout=30)
    finally:
        process.stop()
    assert all(s.code == grpc.StatusCode.UNAVAILABLE and s.stats is None for s in streams), [
        (s.code, s.details) for s in streams
    ]
    assert isinstance(sdk_error, errors.Unavailable), sdk_error
    # Each stream is a prefix of a committed log that stays in Redis, unfinished.
    records = [await store.load(sid) for sid in set(await store.session_ids()) - before]
    ours = []
    for prompt, s in zip(prompts, streams, strict=False):
        mine = [
            r
            for r in records
            if r.token_ids[: r.prompt_len] == prompt
            and not r.finished
            and r.generated_token_ids[: len(s.tokens)] == tuple(s.tokens)
            and len(s.tokens) <= len(r.generated_token_ids) < MAX_NEW
        ]
        assert len(mine) == 1, f"no single unfinished log holds what the stream of {prompt} received"
        ours.append(mine[0].session_id)

    async def leases_gone() -> bool:
        return all([await store.lease_owner(sid) is None for sid in ours])

    assert not await leases_gone(), "the dead coordinator held no lease (nothing to lapse)"
    # The dead owner's leases lapse within their TTL; the logs stay.
    await wait_until(leases_gone, timeout_s=lease_ttl_s + 3, what="the leases to lapse", poll_s=0.1)
    for sid in ours:
        assert not (await store.load(sid)).finished


async def test_kill_9_of_the_draft_continues_at_gamma_0(coordinator, workers, store, pair, prompts):
    address = f"127.0.0.1:{coordinator.port}"
    pool = coordinator.coordinator.pool
    draft = workers["draft"]
    greedy = [Stream(sf.request(p, max_new_tokens=MAX_NEW, ignore_eos=True, gamma=4)) for p in prompts[:3]]
    sampled = Stream(
        sf.request(prompts[3], max_new_tokens=MAX_NEW, temperature=1.0, seed=3, ignore_eos=True, gamma=4)
    )
    coupled = [
        Stream(coupled_request(p, 30 + i, max_new_tokens=MAX_NEW, gamma=4)) for i, p in enumerate(prompts[:2])
    ]
    streams = [*greedy, sampled, *coupled]
    tasks = [asyncio.create_task(s.run(address, timeout_s=120)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=90, what="3 tokens each")
    draft.kill()
    at_kill = [len(s.tokens) for s in streams]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    assert any(n < MAX_NEW for n in at_kill), "every session had finished before the kill"
    for s in streams:
        await assert_stream_is_log(store, s)
    for prompt, s in zip(prompts, greedy, strict=False):
        assert s.tokens == reference(pair, prompt, MAX_NEW)
    for i, (prompt, s) in enumerate(zip(prompts, coupled, strict=False)):
        assert s.tokens == sf.reference_coupled(pair.target_dir, prompt, MAX_NEW, seed=30 + i)
    assert pool.drafts.failures(draft.address) >= 1 or not pool.drafts.is_up(draft.address)

    # A session started after the kill runs at gamma = 0 throughout: no proposals, same output.
    after = await Stream(sf.request(prompts[4], max_new_tokens=16, ignore_eos=True, gamma=4)).run(address)
    await assert_stream_is_log(store, after)
    assert after.tokens == reference(pair, prompts[4], 16)
    assert after.stats.proposed_tokens == 0
    after = await Stream(coupled_request(prompts[4], 34, max_new_tokens=16, gamma=4)).run(address)
    await assert_stream_is_log(store, after)
    assert after.tokens == sf.reference_coupled(pair.target_dir, prompts[4], 16, seed=34)
    assert after.stats.proposed_tokens == 0
