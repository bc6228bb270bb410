"""specserve.draft.engine: calls that arrive together share a batch, a batch is at most max_batch_size, an
n-gram item is refused, an item's error is its own; with a real tiny Llama draft on its real model thread.

To make calls "arrive together" deterministically, the model thread is held busy by a job that waits on
an event (as a long batch would), the calls queue up behind it, then the event is set.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from draft_helpers import draft_settings
from prometheus_client import REGISTRY
from waiting import wait_until

from specserve.api.errors import FailedPrecondition, Unavailable
from specserve.api.params import SamplingParams, SessionBase
from specserve.draft.messages import ProposeCall
from specserve.draft.server import build_draft
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11, 64, 120)
GREEDY = SamplingParams(temperature=0.0)


def call(
    sid: str, committed=PROMPT, *, gamma=3, start=0, proposer=common_pb2.PROPOSER_KIND_MODEL
) -> ProposeCall:
    return ProposeCall(
        base=SessionBase(sid, len(committed), 0),
        start_position=start,
        token_ids=tuple(committed[start:]),
        sampling=GREEDY,
        gamma=gamma,
        proposer=proposer,
        draft_top_k=0,
        seed=0,
    )


@pytest.fixture
def engine(llama_draft):
    app = build_draft(draft_settings(max_batch_size=3), model=llama_draft)
    yield app.engine
    app.engine.close()


class Held:
    """Holds the engine's model thread busy until :meth:`release`."""

    def __init__(self, engine) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.job = asyncio.ensure_future(engine.thread.run(self._hold))

    def _hold(self) -> None:
        self.started.set()
        self.gate.wait(timeout=60)

    async def __aenter__(self) -> Held:
        await asyncio.to_thread(self.started.wait, 60)
        return self

    async def __aexit__(self, *exc) -> None:
        self.gate.set()
        await self.job


def gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


async def test_calls_that_arrive_together_share_one_pass(engine):
    async with Held(engine):
        tasks = [asyncio.ensure_future(engine.propose(call(f"t{i}", PROMPT[i:]))) for i in range(3)]
        await wait_until(lambda: engine.queue_depth == 3, timeout_s=10, what="3 calls queued")
        assert gauge("specserve_draft_queue_depth") == 3
    results = await asyncio.gather(*tasks)
    assert (engine.batches, engine.items_drafted) == (1, 3)
    assert all(len(r.drafted.token_ids) == 3 for r in results)
    assert gauge("specserve_draft_batch_occupancy") == 1.0  # 3 of max_batch_size 3
    await engine.idle()  # the batch's bookkeeping ends on the model thread, after the results are out
    assert engine.queue_depth == 0 and gauge("specserve_draft_queue_depth") == 0
    alone = await engine.propose(call("t0", PROMPT))  # a retry drafted alone: the same tokens
    assert alone.drafted.token_ids == results[0].drafted.token_ids


async def test_a_batch_is_at_most_max_batch_size(engine):
    async with Held(engine):
        task = asyncio.ensure_future(engine.propose_batch([call(f"m{i}", PROMPT[i:]) for i in range(5)]))
        await wait_until(lambda: engine.queue_depth == 5, timeout_s=10, what="5 calls queued")
    results = await task
    assert (engine.batches, engine.items_drafted) == (2, 5)  # 3 + 2
    assert [len(r.drafted.token_ids) for r in results] == [3] * 5


async def test_an_ngram_item_is_refused_alone_the_coordinator_drafts_it(engine):
    pattern = (10, 20, 30, 40)
    outcomes = await engine.propose_batch(
        [call("m", PROMPT), call("ng", pattern * 2 + (10,), proposer=common_pb2.PROPOSER_KIND_NGRAM)]
    )
    assert len(outcomes[0].drafted.token_ids) == 3
    assert isinstance(outcomes[1], FailedPrecondition) and "coordinator drafts" in outcomes[1].message


async def test_an_items_error_is_its_own(engine):
    outcomes = await engine.propose_batch(
        [call("ok", PROMPT), call("cold", PROMPT, start=4), call("ok2", PROMPT)]
    )
    assert len(outcomes[0].drafted.token_ids) == 3 and len(outcomes[2].drafted.token_ids) == 3
    assert isinstance(outcomes[1], FailedPrecondition) and "position 0" in outcomes[1].message
    with pytest.raises(FailedPrecondition):
        await engine.propose(call("cold", PROMPT, start=4))


async def test_drafting_stops_at_eos_unless_the_session_ignores_it(llama_draft):
    probe = build_draft(draft_settings(), model=llama_draft)
    try:
        free = await probe.engine.propose(call("p", PROMPT, gamma=4))
    finally:
        probe.engine.close()
    first = free.drafted.token_ids[0]
    app = build_draft(draft_settings(), model=llama_draft)
    app.engine.eos_token_ids = frozenset({first})  # as if the draft's EOS were the token it drafts first
    try:
        stopped = await app.engine.propose(call("e", PROMPT, gamma=4))
        assert stopped.drafted.token_ids == (first,)
        ignoring = call("i", PROMPT, gamma=4)
        ignoring = ProposeCall(**{**ignoring.__dict__, "ignore_eos": True})
        assert (await app.engine.propose(ignoring)).drafted.token_ids == free.drafted.token_ids
    finally:
        app.engine.close()


async def test_items_queued_when_the_model_thread_stops_fail_instead_of_hanging(llama_draft):
    app = build_draft(draft_settings(), model=llama_draft)
    engine = app.engine
    held = Held(engine)
    async with held:
        task = asyncio.ensure_future(engine.propose(call("late", PROMPT)))
        await wait_until(lambda: engine.queue_depth == 1, timeout_s=10, what="the call queued")
        engine.close()  # the drain scheduled behind the held job never starts
    with pytest.raises(Unavailable, match="model thread stopped"):
        await asyncio.wait_for(task, 30)
