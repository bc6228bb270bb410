"""Gathers the items of many sessions bound for one worker replica into one call.

One :class:`Batcher` per replica and kind of call, a :class:`VerifyBatcher` per target replica and a
:class:`ProposeBatcher` per draft replica: it waits for more items only while sessions bound to the replica
are about to submit, keeps at most ``max_in_flight`` calls running (the next rounds join the following call),
sends an item under a constraint the replica has not answered for in a call of its own
(:class:`ConstraintSightings`), and resolves each item with its own result (docs/design.md, "Batched
drafting": "How a batch forms").
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog

from specserve.api.errors import SpecServeError
from specserve.coordinator.fleet.clients import (
    DraftCall,
    DraftClient,
    ProposeBatchReply,
    TargetClient,
    VerifyReply,
)
from specserve.coordinator.messages import CallCost, Proposal, Verified, VerifyRequest
from specserve.runtime import metrics
from specserve.runtime.interceptors import clean_request_ids, current_request_id

log = structlog.get_logger(__name__)

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


#: Constraints remembered per replica: the workers' compiled-grammar cache size (specserve.engine.grammar).
SIGHTINGS_PER_REPLICA = 256


class ConstraintSightings:
    """Which constraints each replica has answered an item for lately (the most recent
    ``per_replica`` kept): an item whose constraint a replica has not seen goes ``alone``, since
    that replica compiles the constraint before it answers (docs/design.md, "Constrained decoding"). A replica
    that evicted or never kept a grammar still compiles it off its model thread; only the
    items batched with it would then wait."""

    def __init__(self, per_replica: int = SIGHTINGS_PER_REPLICA) -> None:
        self.per_replica = per_replica
        self._seen: dict[str, OrderedDict[Any, None]] = {}

    def new_to(self, endpoint: str, constraint: Any | None) -> bool:
        """Whether ``endpoint`` has not answered an item under ``constraint`` lately (False for None)."""
        return constraint is not None and constraint not in self._seen.get(endpoint, ())

    def answered(self, endpoint: str, constraint: Any | None) -> None:
        """Record that ``endpoint`` answered an item under ``constraint`` (it holds the grammar now)."""
        if constraint is None:
            return
        seen = self._seen.setdefault(endpoint, OrderedDict())
        seen[constraint] = None
        seen.move_to_end(constraint)
        while len(seen) > self.per_replica:
            seen.popitem(last=False)


@dataclass(frozen=True)
class BatchedProposal:
    """A ProposeBatch item's outcome (its proposal, or the error that kept it from being drafted) and its call's cost."""

    proposal: Proposal | None
    error: SpecServeError | None
    cost: CallCost


@dataclass
class _Pending(Generic[ItemT, ResultT]):
    item: ItemT
    future: asyncio.Future[ResultT]
    submitted_ns: int
    request_id: str | None = None


class Batcher(abc.ABC, Generic[ItemT, ResultT]):
    """Batches one kind of item for one replica (see the module docstring).

    Subclasses say how a batch is sent (:meth:`_send`) and how its reply is
    split into one result per item (:meth:`_split`).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        max_batch_size: int,
        max_wait_s: float,
        max_in_flight: int = 1,
        expected: Callable[[], int] | None = None,
        depth: Any = None,
    ) -> None:
        if max_batch_size < 1 or max_wait_s < 0 or max_in_flight < 1:
            raise ValueError("need max_batch_size >= 1, max_wait_s >= 0, max_in_flight >= 1")
        self.endpoint = endpoint
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        #: Sessions that will submit here soon; the batch waits only for them.
        self._expected = expected or (lambda: max_batch_size)
        self._queue: list[_Pending[ItemT, ResultT]] = []
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._calls: set[asyncio.Task[None]] = set()
        self._closed = False
        self._depth = depth  # a gauge (labelled child) of the items waiting, or None
        #: The constraints this replica answered for lately: an item under another one goes ``alone``.
        self.sightings = ConstraintSightings()
        self._task = asyncio.create_task(self._run(), name=f"{type(self).__name__}-{endpoint}")
        self.in_flight_items = 0
        #: Items sent and calls made, for the load estimate and tests.
        self.items_sent = 0
        self.calls_made = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def submit(self, item: ItemT, *, constraint: Any | None = None) -> ResultT:
        """Queue ``item``; resolves when its batch returns (raises when the whole call failed).

        ``constraint``: the item's; while this replica has not answered for it lately the item goes alone, now,
        in a call that takes no ``max_in_flight`` slot (docs/design.md, "Constrained decoding")."""
        alone = self.sightings.new_to(self.endpoint, constraint)
        result = await self._submit(item, alone=alone)
        if self._answered(result):
            self.sightings.answered(self.endpoint, constraint)
        return result

    def _answered(self, result: ResultT) -> bool:
        """Whether the replica answered for the item (its constraint is compiled there now)."""
        return True

    async def _submit(self, item: ItemT, *, alone: bool) -> ResultT:
        if self._closed:
            raise RuntimeError("the batcher is closed")
        future: asyncio.Future[ResultT] = asyncio.get_running_loop().create_future()
        pending = _Pending(item, future, time.perf_counter_ns(), current_request_id())
        if alone:
            self._start_call([pending], holds_slot=False)
        else:
            self._queue.append(pending)
            self._set_depth()
            self._wakeup.set()
        return await future

    def _batch_len(self) -> int:
        """How many queued items the next call takes: at most ``max_batch_size``, and no more than fit
        within :meth:`_bytes_limit` (at least one)."""
        n = min(len(self._queue), self.max_batch_size)
        limit = self._bytes_limit()
        if limit is None:
            return n
        total = 0
        for i in range(n):
            total += self._item_bytes(self._queue[i].item)
            if i and total > limit:
                return i
        return n

    def _bytes_limit(self) -> int | None:
        """Most bytes of :meth:`_item_bytes` one call carries (None: no limit)."""
        return None

    def _item_bytes(self, item: ItemT) -> int:
        """An item's bytes that :meth:`_bytes_limit` bounds."""
        return 0

    @abc.abstractmethod
    async def _send(self, items: list[ItemT]) -> Any:
        """Make the call for ``items``; raises when the whole call fails."""

    @abc.abstractmethod
    def _split(
        self, batch: list[_Pending[ItemT, ResultT]], reply: Any, sent_ns: int, call_ns: int
    ) -> list[ResultT]:
        """One result per item of ``batch``, in order; the first carries ``reports_call``."""

    def _set_depth(self) -> None:
        if self._depth is not None:
            self._depth.set(len(self._queue))

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._slots.acquire()
                if len(self._queue) < self.max_batch_size and self.max_wait_s > 0:
                    await self._wait_for_more()
                take = self._batch_len()
                batch, self._queue = self._queue[:take], self._queue[take:]
                self._set_depth()
                batch = [p for p in batch if not p.future.done()]  # cancelled while queued
                if not batch:
                    self._slots.release()
                    continue
                self._start_call(batch, holds_slot=True)

    def _start_call(self, batch: list[_Pending[ItemT, ResultT]], *, holds_slot: bool) -> None:
        self.in_flight_items += len(batch)
        task = asyncio.create_task(self._call(batch, holds_slot=holds_slot))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _wait_for_more(self) -> None:
        deadline = time.monotonic() + self.max_wait_s
        while len(self._queue) < self.max_batch_size and self._expected() > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    async def _call(self, batch: list[_Pending[ItemT, ResultT]], *, holds_slot: bool) -> None:
        # This task's own context: the call carries the request ids of its items, joined and capped
        # below gRPC's metadata limit (clean_request_ids), so no item's id can fail the call.
        structlog.contextvars.bind_contextvars(request_id=clean_request_ids([p.request_id for p in batch]))
        sent_ns = time.perf_counter_ns()
        try:
            reply = await self._send([p.item for p in batch])
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self.in_flight_items -= len(batch)
            if holds_slot:
                self._slots.release()
            self.calls_made += 1
            self.items_sent += len(batch)
            if self._queue:
                self._wakeup.set()
        call_ns = time.perf_counter_ns() - sent_ns
        for p, result in zip(batch, self._split(batch, reply, sent_ns, call_ns), strict=True):
            if not p.future.done():
                p.future.set_result(result)

    async def close(self) -> None:
        """Stop batching; calls in flight finish, queued items fail."""
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(RuntimeError("the coordinator is shutting down"))
        self._queue.clear()
        self._set_depth()


class VerifyBatcher(Batcher[VerifyRequest, Verified]):
    """Batches Verify items for one target replica.

    ``on_call``: optional hook, called once per successful call with batch_size,
    positions, verify_ns, call_ns, tokens (instrumentation; the pool reads the
    cost from ``reports_call`` results).
    """

    def __init__(
        self,
        client: TargetClient,
        *,
        max_batch_size: int,
        max_wait_s: float,
        max_in_flight: int = 1,
        on_call: Callable[..., None] | None = None,
        expected: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        self._on_call = on_call
        super().__init__(
            client.endpoint,
            max_batch_size=max_batch_size,
            max_wait_s=max_wait_s,
            max_in_flight=max_in_flight,
            expected=expected,
            depth=metrics.VERIFY_QUEUE_DEPTH.labels(target=client.endpoint),
        )

    async def _send(self, items: list[VerifyRequest]) -> VerifyReply:
        return await self.client.verify(items)

    def _split(self, batch, reply: VerifyReply, sent_ns: int, call_ns: int) -> list[Verified]:
        tokens = sum(len(p.item.proposal.distributions) for p in batch)
        if self._on_call is not None:
            try:
                self._on_call(
                    batch_size=len(batch),
                    positions=reply.positions_processed,
                    verify_ns=reply.verify_ns,
                    call_ns=call_ns,
                    tokens=tokens,
                )
            except Exception:  # statistics must never fail a batch
                log.exception("batch_observer_failed")
        first = _first_live(batch)
        steps = max(max(p.item.decode_steps, 1) for p in batch)
        return [
            dataclasses.replace(
                result,
                cost=CallCost(
                    queue_ns=sent_ns - p.submitted_ns,
                    call_ns=call_ns,
                    verify_ns=reply.verify_ns,
                    forward_ns=reply.forward_ns,
                    batch_size=len(batch),
                    positions_processed=reply.positions_processed,
                    draft_tokens=tokens,
                    reports_call=i == first,
                    decode_steps=steps,
                ),
            )
            for i, (p, result) in enumerate(zip(batch, reply.results, strict=True))
        ]


class ProposeBatcher(Batcher[DraftCall, BatchedProposal]):
    """Batches Propose requests for one draft replica into ``ProposeBatch`` calls, each carrying at most
    ``max_feature_bytes`` of the target's features (its items together; an item alone may carry that much:
    the relay sends no more per item)."""

    def __init__(
        self,
        client: DraftClient,
        *,
        max_batch_size: int,
        max_wait_s: float,
        expected: Callable[[], int] | None = None,
        max_feature_bytes: int | None = None,
    ) -> None:
        self.client = client
        self.max_feature_bytes = max_feature_bytes
        super().__init__(
            client.endpoint,
            max_batch_size=max_batch_size,
            max_wait_s=max_wait_s,
            max_in_flight=1,
            expected=expected,
            depth=metrics.PROPOSE_QUEUE_DEPTH.labels(draft=client.endpoint),
        )

    def _answered(self, result: BatchedProposal) -> bool:
        return result.error is None

    def _bytes_limit(self) -> int | None:
        return self.max_feature_bytes

    def _item_bytes(self, item: DraftCall) -> int:
        return 0 if item.features is None else len(item.features.data)

    async def _send(self, items: list[DraftCall]) -> ProposeBatchReply:
        return await self.client.propose_batch(items)

    def _split(self, batch, reply: ProposeBatchReply, sent_ns: int, call_ns: int) -> list[BatchedProposal]:
        first = _first_live(batch)
        if first >= 0:
            metrics.PROPOSE_BATCH_SIZE.observe(len(batch))
        out = []
        for i, (p, result) in enumerate(zip(batch, reply.results, strict=True)):
            cost = CallCost(queue_ns=sent_ns - p.submitted_ns, call_ns=call_ns, batch_size=len(batch), reports_call=i == first)
            if isinstance(result, SpecServeError):
                out.append(BatchedProposal(None, result, cost))
            else:
                out.append(BatchedProposal(dataclasses.replace(result, queue_ns=cost.queue_ns), None, cost))
        return out


def _first_live(batch: list[_Pending]) -> int:
    """The index of the first item whose caller still waits (-1: none): its result reports the call."""
    return next((i for i, p in enumerate(batch) if not p.future.done()), -1)
