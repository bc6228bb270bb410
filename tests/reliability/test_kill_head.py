"""``kill -9`` of a draft replica serving the feature head, mid-stream (docs/design.md, "The feature head").

One target and two draft processes (``specserve serve``, forked from the
pre-imported launcher), both serving the same tiny head
(``system_fixtures.tiny_head``, trained on the target's continuations of the
prompts below, so its proposals there are accepted); the coordinator runs in
the test process. Eight greedy streams draft with ``proposer="feature"``; once
each has a few tokens, the draft replica that most of them draft on is killed.
Every stream must equal the target alone and no session may fail; the sessions
that were on the dead replica continue on the other, which rebuilds each head
context from the features the coordinator keeps, and their acceptance after
the kill must be back near the head's own. Run with chains and with draft
trees from the head's own ranking (every round the chain and its runners-up:
``draft_tree_min_path_probability=0``), each against its own workers.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import pytest_asyncio
import system_fixtures as sf
from reliability_helpers import (
    Stream,
    assert_stream_is_log,
    role_starter,
    serving,
    start_test_coordinator,
    worker_flags,
)
from waiting import wait_until

from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

MAX_NEW = 64
GAMMA = 2
PROMPTS = [[(7 * i + 13 * j) % 380 + 2 for j in range(4 + i % 3)] for i in range(8)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory, seed=3)


TREES = {"draft_tree_nodes": 6, "draft_tree_min_path_probability": 0.0}


@pytest.fixture(scope="module", params=[{}, TREES], ids=["chains", "trees"])
def shape(request) -> dict:
    """The coordinator's tree settings."""
    return request.param


@pytest.fixture(scope="module")
def workers(request, pair, redis_server, tmp_path_factory, shape):
    # ``shape``: fresh workers for each (the test kills a draft replica).
    head = sf.tiny_head(pair, tmp_path_factory, PROMPTS, length=MAX_NEW + 8)
    start = role_starter(request, tmp_path_factory)
    common = {"shutdown_grace_s": 1, **sf.head_overrides(pair, head)}
    target = start("target", worker_flags(pair.target_dir, redis_server.url, shutdown_grace_s=1))
    drafts = [start("draft", worker_flags(pair.draft_dir, redis_server.url, **common)) for _ in range(2)]
    with serving([target, *drafts]):
        yield {"target": target, "drafts": drafts}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def coordinator(workers, pair, redis_server, shape):
    app = await start_test_coordinator(
        pair.target_dir,
        redis_server.url,
        targets=[workers["target"].address],
        drafts=[d.address for d in workers["drafts"]],
        rpc_timeout_s=3.0,
        default_proposer="auto",
        **shape,
    )
    yield app
    await app.stop(grace=1.0)


async def test_kill_9_of_a_head_replica_mid_stream(coordinator, workers, store, pair, shape):
    address = f"127.0.0.1:{coordinator.port}"
    pool = coordinator.coordinator.pool
    assert coordinator.coordinator.default_proposer == common_pb2.PROPOSER_KIND_FEATURE
    streams = [
        Stream(sf.request(p, max_new_tokens=MAX_NEW, gamma=GAMMA, ignore_eos=True, proposer=common_pb2.PROPOSER_KIND_FEATURE))
        for p in PROMPTS
    ]
    tasks = [asyncio.create_task(s.run(address, timeout_s=150)) for s in streams]
    seen: set[str] = set()

    def started() -> bool:
        seen.update(pool.bound_targets())
        return all(len(s.tokens) >= 4 for s in streams) or any(s.done for s in streams)

    await wait_until(started, timeout_s=90, what="4 tokens each", poll_s=0.01)
    # The replica each running session drafts on (the pool's routing), and the one most of them use.
    on = {sid: pool.draft_of(sid) for sid in seen}
    victim_address = Counter(on.values()).most_common(1)[0][0]
    victim = next(d for d in workers["drafts"] if d.address == victim_address)
    victim.kill()
    at_kill = [len(s.tokens) for s in streams]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    assert all(s.ok for s in streams), [(s.code, s.details) for s in streams if not s.ok]
    for prompt, s in zip(PROMPTS, streams, strict=True):
        await assert_stream_is_log(store, s)
        assert s.tokens == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
    moved = [(s, n) for s, n in zip(streams, at_kill, strict=True) if on.get(s.session_id) == victim_address]
    assert moved and all(n < MAX_NEW // 2 for _, n in moved), "sessions were on the killed replica, early"
    assert pool.drafts.failures(victim_address) >= 1 or not pool.drafts.is_up(victim_address)
    for s, n in moved:
        # Before the kill the session accepted at most the n tokens it had; after it, the other replica drafts
        # from a context rebuilt from the coordinator's features. A round of GAMMA accepted tokens commits
        # GAMMA + 1, so the head's own rate is 2/3 of the tokens; a lost or broken rebuild would accept ~0.
        after = s.stats.accepted_tokens - n
        assert after >= 0.4 * (MAX_NEW - n), (s.stats.accepted_tokens, s.stats.proposed_tokens, n)
    # With trees every drafting round proposed more nodes than its GAMMA levels.
    branched = [s.stats.proposed_tokens > GAMMA * s.stats.draft_rounds for s in streams]
    assert all(branched) if shape else not any(branched)
