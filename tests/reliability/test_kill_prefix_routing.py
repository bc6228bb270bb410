"""``kill -9`` of the replica a shared prompt prefix is routed to, mid-stream (docs/design.md, "Routing by prefix").

Two target and two draft processes (``specserve serve ROLE``, forked from the pre-imported launcher as in
``test_kill.py``; the prefix cache on, as by default; each with its own ``/metrics``), the session's real Redis,
and two coordinators in the test process built from the same settings, sharing nothing but the endpoint lists
(tiny float32 Llama pair). The sessions' prompts share their first 80 tokens (5 whole prefix-cache blocks, more
than the 64 that routing keys on) and differ after them. For the target tier, then for the draft tier:

* a first session puts the prefix in its home replica's cache: the one replica of the tier whose prefix-cache
  queries counter moved;
* six concurrent streams with the prefix, half through each coordinator, all land on that replica (no other
  replica of the tier is queried) and each takes the 80 tokens from its cache (its hits counter; on the target
  tier also each stream's ``cached_tokens``);
* the home replica is killed with SIGKILL while every one of them is mid-stream: every stream completes, equal to
  its committed log and to greedy ``generate()`` of the target alone, having gone on at the other replica of the
  tier (its queries counter moved);
* later sessions with the prefix, through either coordinator, go to the surviving replica (its queries counter
  moves), come out exact, and from the second one on take the 80 tokens from its cache; after a draft's kill they
  still draft (through the survivor).

Each case starts with all four replicas serving (a replica killed in the other case is started again on its
port, with an empty cache) and two fresh coordinators.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from reliability_helpers import (
    RoleProcess,
    Stream,
    assert_stream_is_log,
    metric,
    replicas,
    restart,
    role_starter,
    start_test_coordinator,
)
from waiting import wait_until

from specserve.runtime.config import CoordinatorSettings, TargetSettings
from specserve.v1 import coordinator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = TargetSettings.model_fields["prefix_block_tokens"].default  # the workers' prefix-cache block
KEY = CoordinatorSettings.model_fields["route_prefix_tokens"].default  # the tokens routing hashes
PREFIX = 5 * BLOCK  # the tokens every session's prompt starts with
STREAMS = 6  # concurrent streams when the home replica is killed
LATER = 2  # new sessions after the kill
MAX_NEW = 64
GAMMA = 3
SEEDS = {"targets": 1, "drafts": 2}  # each case's prefix, one the other case's replicas never saw


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def processes(request, pair, redis_server, tmp_path_factory):
    """How roles are started, and ``{"targets": [...], "drafts": [...]}``: two of each, each with a metrics port."""
    start = role_starter(request, tmp_path_factory)
    with replicas(start, pair, redis_server.url, targets=2, drafts=2, metrics=True) as roles:
        yield start, roles


@pytest.fixture
def workers(processes) -> dict[str, list[RoleProcess]]:
    """The module's replicas, every one serving: one killed by an earlier case is started again on its port."""
    start, roles = processes
    for tier in roles.values():
        for i, role in enumerate(tier):
            if not role.alive:
                tier[i] = restart(start, role)
    return roles


@pytest_asyncio.fixture(loop_scope="module")
async def coordinators(workers, pair, redis_server):
    """Two coordinators from the same settings (addresses); a dead replica stays backed off for the test."""
    settings = {
        "targets": [t.address for t in workers["targets"]],
        "drafts": [d.address for d in workers["drafts"]],
        "rpc_timeout_s": 3.0,
        "target_backoff_s": 30.0,
        "target_max_backoff_s": 30.0,
        "draft_backoff_s": 30.0,
        "draft_max_backoff_s": 30.0,
    }
    apps = [await start_test_coordinator(pair.target_dir, redis_server.url, **settings) for _ in range(2)]
    yield [f"127.0.0.1:{app.port}" for app in apps]
    for app in apps:
        await app.stop(grace=1.0)


def prompts(pair, seed: int, n: int) -> list[list[int]]:
    """``n`` prompts that share their first :data:`PREFIX` tokens (``seed`` picks them) and differ after."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(pair.tokenizer)
    shared = torch.randint(1, vocab, (PREFIX,), generator=gen).tolist()
    return [shared + torch.randint(1, vocab, (BLOCK // 2 + 1,), generator=gen).tolist() for _ in range(n)]


async def lookups(role: RoleProcess) -> tuple[float, float]:
    """Tokens ``role``'s prefix cache was asked for and tokens it held, so far (its Prometheus counters)."""

    def read() -> tuple[float, float]:
        labels = {"role": role.role}
        return (
            metric(role, "specserve_prefix_cache_queries_total", labels),
            metric(role, "specserve_prefix_cache_hits_total", labels),
        )

    return await asyncio.to_thread(read)


async def counters(roles: list[RoleProcess]) -> dict[str, tuple[float, float]]:
    """Per replica address, (queried, hit) tokens so far."""
    return {r.address: await lookups(r) for r in roles}


async def since(
    roles: list[RoleProcess], before: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    """Per replica address, (queried, hit) tokens since ``before``."""
    now = await counters(roles)
    return {a: (now[a][0] - before[a][0], now[a][1] - before[a][1]) for a in now}


def next_tokens(pair, prompt: list[int]) -> list[int]:
    """A next turn's new tokens for the conversation that started with ``prompt``."""
    gen = torch.Generator().manual_seed(sum(prompt))
    return torch.randint(1, len(pair.tokenizer), (BLOCK + 7,), generator=gen).tolist()


def request(prompt: list[int], max_new_tokens: int = MAX_NEW):
    """A greedy request for exactly ``max_new_tokens`` tokens at a fixed gamma."""
    return sf.request(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, gamma=GAMMA)


async def exact(store, pair, prompt: list[int], stream: Stream) -> coordinator_pb2.GenerationStats:
    """The stream completed, equals its committed log and the target's own greedy ``generate()``; its stats."""
    await assert_stream_is_log(store, stream)
    n = stream.request.stop.max_new_tokens
    assert stream.tokens == sf.reference_greedy(pair.target_dir, prompt, n, ignore_eos=True)
    assert stream.stats is not None
    return stream.stats


@pytest.mark.parametrize("tier", ["targets", "drafts"])
async def test_kill_9_of_the_prefix_home_mid_stream_fails_over_to_the_other_replica(
    tier, workers, coordinators, store, pair
):
    assert PREFIX > KEY  # the shared tokens decide the route
    tier_roles = workers[tier]
    first, *rest = prompts(pair, seed=SEEDS[tier], n=1 + STREAMS + LATER)
    streaming, later = rest[:STREAMS], rest[STREAMS:]

    # The first session puts the prefix in its home replica's cache.
    before = await counters(tier_roles)
    await exact(store, pair, first, await Stream(request(first, 8)).run(coordinators[0]))
    queried = {a for a, (q, _) in (await since(tier_roles, before)).items() if q > 0}
    assert len(queried) == 1, f"the first session was looked up on {queried}"
    (home,) = [r for r in tier_roles if r.address in queried]
    (survivor,) = [r for r in tier_roles if r is not home]

    # Concurrent streams through both coordinators: all at home, each taking the prefix from its cache.
    before = await counters(tier_roles)
    streams = [Stream(request(p)) for p in streaming]
    tasks = [asyncio.create_task(s.run(coordinators[i % 2], timeout_s=120)) for i, s in enumerate(streams)]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=90, what="3 tokens each")
    placed = await since(tier_roles, before)
    assert placed[survivor.address] == (0, 0), "a stream was placed away from the prefix's home"
    # Every stream was looked up at home and attached the 5 shared blocks there.
    assert placed[home.address] == (sum(len(p) for p in streaming), PREFIX * STREAMS), placed
    home.kill()
    at_kill = [len(s.tokens) for s in streams]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    assert all(n < MAX_NEW for n in at_kill), f"a stream had finished before the kill: {at_kill}"
    assert (await since([survivor], before))[survivor.address][0] > 0, "no stream went on at the survivor"
    for prompt, s in zip(streaming, streams, strict=True):
        stats = await exact(store, pair, prompt, s)
        if tier == "targets":
            assert stats.cached_tokens == PREFIX

    # Each conversation's next turn, and new sessions with the prefix, go to the survivor (every prompt is looked
    # up there) and find their prefix there: the streams left it when they went on there.
    turns = [p + s.tokens + next_tokens(pair, p) for p, s in zip(streaming, streams, strict=True)]
    before = await counters([survivor])
    nexts = [Stream(request(t, 16)) for t in turns]
    await asyncio.gather(*(s.run(coordinators[i % 2]) for i, s in enumerate(nexts)))
    queried_now, hit_now = (await since([survivor], before))[survivor.address]
    assert queried_now == sum(len(t) for t in turns), "a next turn was not looked up on the survivor"
    assert hit_now >= PREFIX * STREAMS
    for prompt, previous, s in zip(turns, streaming, nexts, strict=True):
        stats = await exact(store, pair, prompt, s)
        if tier == "targets":  # the whole last turn (all its whole blocks but for the pending last token)
            assert stats.cached_tokens == (len(previous) + MAX_NEW - 1) // BLOCK * BLOCK
    for i, prompt in enumerate(later):
        before = await counters([survivor])
        s = await Stream(request(prompt, 16)).run(coordinators[i % 2])
        stats = await exact(store, pair, prompt, s)
        assert (await since([survivor], before))[survivor.address] == (len(prompt), PREFIX), (
            f"later session {i}"
        )
        if tier == "targets":
            assert stats.cached_tokens == PREFIX
        else:
            assert stats.proposed_tokens > 0  # drafted through the surviving draft replica
