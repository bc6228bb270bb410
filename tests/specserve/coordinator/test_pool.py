"""specserve.coordinator.fleet.pool's draft side through the whole system (real Redis, gRPC servers on loopback, tiny float32
models): concurrent sessions draft in shared ProposeBatch calls and stay exact, n-gram proposals never wait
for a batch (they are made in the coordinator), a failed draft call opens the breaker once, and batching follows the
draft's own limit."""

from __future__ import annotations

import asyncio

import pytest
import system_fixtures as sf
from prometheus_client import REGISTRY

from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_NEW = 20
TEXTS = (
    "def add(a, b):\n",
    "for i in range(10):\n    print",
    "the quick brown",
    "class Point:\n    def",
    "import os\nimport",
    "while True:\n",
    "if x is None:\n",
    "def sub(a, b):\n    return",
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(pair, prompts):
    return [sf.reference_greedy(pair.target_dir, p, MAX_NEW, ignore_eos=True) for p in prompts]


def _failures(tier: str) -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_replica_failures_total", {"tier": tier}) or 0.0


async def test_concurrent_sessions_draft_in_shared_batches_and_stay_exact(
    pair, redis_server, prompts, expected
):
    """Eight greedy sessions at once (gamma 2 and 4): their proposals travel in shared ProposeBatch calls, the
    draft drafts them in fewer batches than proposals, and every output equals the target's own greedy text."""
    overrides = {"draft_batch_wait_ms": 200.0}
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=overrides) as stack:
        pool = stack.coordinator.coordinator.pool
        (batcher,) = pool.propose_batchers.values()
        requests = [
            sf.request(p, max_new_tokens=MAX_NEW, gamma=2 + 2 * (i % 2), ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        outs = await asyncio.gather(*(sf.generate(stack.address, r) for r in requests))
        assert [o.token_ids for o in outs] == expected
        assert batcher.items_sent > 2 * batcher.calls_made  # more than two sessions per call on average
        engine = stack.draft.engine
        assert engine.items_drafted >= batcher.items_sent and engine.batches < engine.items_drafted / 2
        assert batcher.queued == 0 and set(pool.drafting_sessions().values()) == {0}  # all accounted


async def test_ngram_proposals_are_made_in_the_coordinator_without_a_draft_call(pair, redis_server):
    """The n-gram lookup needs only the committed tokens, which the coordinator holds: no Propose reaches the
    draft (its history never hears of the session), and it works with no draft tier at all."""
    ids = pair.tokenizer.encode("def add(a, b):\n    return a + b\ndef add(a, b):\n", add_special_tokens=False)
    request = sf.request(ids, max_new_tokens=12, gamma=4, proposer=common_pb2.PROPOSER_KIND_NGRAM, ignore_eos=True)
    want = sf.reference_greedy(pair.target_dir, ids, 12, ignore_eos=True)
    async with sf.local_stack(pair, redis_server.url) as stack:
        (batcher,) = stack.coordinator.coordinator.pool.propose_batchers.values()
        out = await sf.generate(stack.address, request)
        assert out.token_ids == want
        assert out.stats.proposed_tokens > 0
        assert batcher.items_sent == 0 and stack.draft.engine.batches == 0
        assert out.stats.session_id not in stack.draft.engine.history
    async with sf.local_stack(pair, redis_server.url, with_draft=False) as stack:
        out = await sf.generate(stack.address, request)
        assert out.token_ids == want and out.stats.proposed_tokens > 0


async def test_a_failed_draft_batch_opens_the_breaker_once(pair, redis_server, prompts, expected):
    """The draft is down: the first proposals fail (several of them in one ProposeBatch call); the replica's
    breaker opens once, and every session finishes at gamma = 0 with the target's greedy text."""
    overrides = {"draft_backoff_s": 120.0, "draft_max_backoff_s": 120.0, "draft_batch_wait_ms": 50.0}
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=overrides) as stack:
        pool = stack.coordinator.coordinator.pool
        (endpoint,) = pool.propose_batchers
        await stack.stop_draft()
        before = _failures("draft")
        requests = [sf.request(p, max_new_tokens=MAX_NEW, gamma=4, ignore_eos=True) for p in prompts[:4]]
        outs = await asyncio.gather(*(sf.generate(stack.address, r) for r in requests))
        assert [o.token_ids for o in outs] == expected[:4]
        assert all(o.stats.proposed_tokens == 0 for o in outs)
        assert _failures("draft") - before == 1
        assert pool.drafts.failures(endpoint) == 1


async def test_a_draft_that_drafts_alone_gets_no_batches(pair, redis_server, prompts, expected):
    """A draft with max_batch_size 1: the coordinator sends every proposal alone (batching off)."""
    async with sf.local_stack(pair, redis_server.url, draft_overrides={"max_batch_size": 1}) as stack:
        pool = stack.coordinator.coordinator.pool
        assert pool.draft_max_batch_size == 1 and pool.propose_batchers == {}
        out = await sf.generate(
            stack.address, sf.request(prompts[0], max_new_tokens=MAX_NEW, gamma=3, ignore_eos=True)
        )
        assert out.token_ids == expected[0] and out.stats.proposed_tokens > 0
        assert stack.draft.engine.batches == stack.draft.engine.items_drafted > 0
