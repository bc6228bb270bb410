"""The Verify batcher against a real target server: many sessions' items share calls, each
future gets its own session's result, and a failed call fails every item of its batch."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
import pytest_asyncio
import system_fixtures as sf

from specserve.api import errors
from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.coordinator.fleet.batcher import VerifyBatcher
from specserve.coordinator.fleet.clients import TargetClient
from specserve.coordinator.messages import VerifyRequest
from specserve.runtime.config import CoordinatorSettings
from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

SETTINGS = CoordinatorSettings(host="127.0.0.1", target_endpoints=["x:1"], rpc_timeout_s=10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    async with sf.local_stack(pair, redis_server.url, with_draft=False) as s:
        yield s


async def _sessions(store, n):
    ids = [f"batch-{uuid.uuid4().hex}" for _ in range(n)]
    for i, sid in enumerate(ids):
        await store.create(
            sid, (5, 6, 7 + i), SamplingParams(temperature=0.0), StopConditions(max_new_tokens=4)
        )
    return ids


def _item(sid):
    return VerifyRequest(SessionBase(sid, 3, 0))


async def test_items_of_many_sessions_share_calls_and_get_their_own_results(stack, store):
    client = TargetClient(f"127.0.0.1:{stack.target_ports[0]}", SETTINGS)
    calls = []
    batcher = VerifyBatcher(
        client, max_batch_size=4, max_wait_s=0.05, on_call=lambda **kw: calls.append(kw), expected=lambda: 10
    )
    try:
        ids = await _sessions(store, 10)
        results = await asyncio.gather(*(batcher.submit(_item(sid)) for sid in ids))
        assert [r.session_id for r in results] == ids
        assert all(r.verdict is not None and r.verdict.new_version == 1 for r in results)
        assert batcher.items_sent == 10 and batcher.calls_made == len(calls) == 3  # 4 + 4 + 2
        assert [c["batch_size"] for c in calls] == [4, 4, 2]
        assert all(r.cost.batch_size in (2, 4) and r.cost.queue_ns >= 0 for r in results)
        for sid in ids:
            assert (await store.load(sid)).version == 1
    finally:
        await batcher.close()
        await client.close()


async def test_a_lone_session_does_not_wait(stack, store):
    """With nobody else expected, the batch goes at once even with a long max wait."""
    client = TargetClient(f"127.0.0.1:{stack.target_ports[0]}", SETTINGS)
    batcher = VerifyBatcher(client, max_batch_size=8, max_wait_s=30.0, expected=lambda: 0)
    try:
        (sid,) = await _sessions(store, 1)
        result = await asyncio.wait_for(batcher.submit(_item(sid)), timeout=20)
        assert result.cost.batch_size == 1
    finally:
        await batcher.close()
        await client.close()


async def test_a_failed_call_fails_every_item_of_its_batch(stack, store):
    client = TargetClient("127.0.0.1:1", SETTINGS)  # nothing listens there
    batcher = VerifyBatcher(client, max_batch_size=8, max_wait_s=0.01, expected=lambda: 3)
    try:
        ids = await _sessions(store, 3)
        results = await asyncio.gather(*(batcher.submit(_item(sid)) for sid in ids), return_exceptions=True)
        assert all(isinstance(r, errors.Unavailable) for r in results)
        for sid in ids:
            assert (await store.load(sid)).version == 0
    finally:
        await batcher.close()
        await client.close()


# ---- the Propose batcher against a real draft server -------------------------------------------

PROMPT = (5, 6, 7, 8, 9, 10)


def _propose_item(sid: str, *, start: int = 0, gamma: int = 3):
    from specserve.coordinator.fleet.clients import DraftCall

    return DraftCall(
        SessionBase(sid, len(PROMPT), 0),
        start_position=start,
        token_ids=PROMPT[start:],
        sampling=SamplingParams(temperature=0.0),
        gamma=gamma,
        proposer=common_pb2.PROPOSER_KIND_MODEL,
        draft_top_k=0,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def draft_stack(pair, redis_server):
    async with sf.local_stack(pair, redis_server.url) as s:
        yield s


async def test_propose_items_of_many_sessions_share_calls_and_get_their_own_results(draft_stack):
    from specserve.coordinator.fleet.batcher import ProposeBatcher
    from specserve.coordinator.fleet.clients import DraftClient

    client = DraftClient(f"127.0.0.1:{draft_stack.draft_port}", SETTINGS)
    batcher = ProposeBatcher(client, max_batch_size=4, max_wait_s=0.05, expected=lambda: 10)
    try:
        ids = [f"pb-{uuid.uuid4().hex}" for _ in range(10)]
        items = [_propose_item(sid, start=3 if i == 5 else 0) for i, sid in enumerate(ids)]
        results = await asyncio.gather(*(batcher.submit(item) for item in items))
        assert batcher.items_sent == 10 and batcher.calls_made == 3  # 4 + 4 + 2
        assert sum(r.cost.reports_call for r in results) == 3
        assert {r.cost.batch_size for r in results} == {4, 2}
        for i, r in enumerate(results):
            if i == 5:  # the draft never saw that session: its own error, nobody else's
                assert r.proposal is None and isinstance(r.error, errors.FailedPrecondition)
            else:
                assert r.error is None and len(r.proposal.token_ids) == 3
        greedy = [r.proposal.token_ids for i, r in enumerate(results) if i != 5]
        assert all(g == greedy[0] for g in greedy)  # the same prompt: the same greedy draft in every batch
    finally:
        await batcher.close()
        await client.close()


async def test_a_propose_call_carries_at_most_its_feature_bytes(draft_stack):
    """Bounded features on the draft hop (issue 54, finding 4): items whose features together pass
    ``max_feature_bytes`` go in separate calls, in order; an item alone may carry that much."""
    from specserve.coordinator.fleet.batcher import ProposeBatcher
    from specserve.coordinator.fleet.clients import DraftClient
    from specserve.core.features import FeatureBlock

    client = DraftClient(f"127.0.0.1:{draft_stack.draft_port}", SETTINGS)
    batcher = ProposeBatcher(client, max_batch_size=8, max_wait_s=0.05, expected=lambda: 6, max_feature_bytes=2500)
    try:
        block = FeatureBlock(start=0, hidden=100, data=bytes(1000))  # 1,000 bytes each (the token draft ignores them)
        items = [dataclasses.replace(_propose_item(f"fb-{uuid.uuid4().hex}"), features=block) for _ in range(6)]
        results = await asyncio.gather(*(batcher.submit(item) for item in items))
        assert batcher.calls_made == 3 and [r.cost.batch_size for r in results] == [2] * 6
        assert all(r.error is None for r in results)
    finally:
        await batcher.close()
        await client.close()


@pytest.mark.unit
async def test_a_failed_propose_call_fails_every_item_of_its_batch():
    from specserve.coordinator.fleet.batcher import ProposeBatcher
    from specserve.coordinator.fleet.clients import DraftClient

    client = DraftClient("127.0.0.1:1", SETTINGS)  # nothing listens there
    batcher = ProposeBatcher(client, max_batch_size=8, max_wait_s=0.01, expected=lambda: 3)
    try:
        items = [_propose_item(f"dead-{i}") for i in range(3)]
        results = await asyncio.gather(*(batcher.submit(i) for i in items), return_exceptions=True)
        assert all(isinstance(r, errors.Unavailable) for r in results)
        assert batcher.calls_made == 1
    finally:
        await batcher.close()
        await client.close()


@pytest.mark.unit
async def test_a_constraint_is_new_to_a_replica_until_it_answered_for_it():
    """The pool sends an item alone while its constraint is new to the replica (ConstraintSightings)."""
    from specserve.coordinator.fleet.batcher import ConstraintSightings

    sightings = ConstraintSightings(per_replica=2)
    assert not sightings.new_to("t:1", None)  # an unconstrained item is never sent alone
    assert sightings.new_to("t:1", "a")
    sightings.answered("t:1", "a")
    assert not sightings.new_to("t:1", "a") and sightings.new_to("t:2", "a")  # per replica
    sightings.answered("t:1", "b")
    sightings.answered("t:1", "c")  # "a" is the least recent of three: forgotten
    assert sightings.new_to("t:1", "a") and not sightings.new_to("t:1", "c")
