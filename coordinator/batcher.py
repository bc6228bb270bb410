"""Gathers the Verify items of many sessions bound for one target replica into one call.

A round :meth:`VerifyBatcher.submit` s its item and awaits a future. A
background task takes the first waiting item, waits up to ``max_wait_s`` for
more (or until ``max_batch_size`` are waiting), sends them as one ``Verify``
call and resolves every item's future with its own result. At most
``max_in_flight`` calls run at once per replica: while a call is in flight the
next rounds queue up and join the following batch, which is what batches
sessions under load without any waiting when the replica is idle and alone.

A failure of the whole call (replica down, deadline) is set on every future of
that batch; per-item errors (stale version, finished session) arrive as
:class:`~coordinator.workers.ItemResult` with ``error`` set.

The call carries the request ids of its items (comma-separated ``x-request-id``),
so each request id appears in the target's logs; the items waiting for a batch
are exported as ``specserve_target_verify_queue_depth{target=...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from coordinator.workers import ItemResult, TargetClient, VerifyReply
from specserve import metrics
from specserve.interceptors import current_request_id
from specserve.v1 import target_pb2

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class BatchedResult:
    """An item's result and what its batch cost."""

    item: ItemResult
    queue_ns: int  # submit -> the call was sent
    call_ns: int  # the call's wall-clock time as this coordinator saw it
    verify_ns: int  # the target's own account of the call
    batch_size: int
    positions_processed: int


@dataclass
class _Pending:
    item: target_pb2.VerifyItem
    future: asyncio.Future[BatchedResult]
    submitted_ns: int
    request_id: str | None = None


class VerifyBatcher:
    """Batches Verify items for one target replica (see the module docstring)."""

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
        if max_batch_size < 1 or max_wait_s < 0 or max_in_flight < 1:
            raise ValueError("need max_batch_size >= 1, max_wait_s >= 0, max_in_flight >= 1")
        self.client = client
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        #: Called once per successful call with batch_size, positions, verify_ns, call_ns, tokens.
        self._on_call = on_call
        #: Sessions that started a round bound here and will submit soon; the batch waits only for them.
        self._expected = expected or (lambda: max_batch_size)
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._calls: set[asyncio.Task[None]] = set()
        self._closed = False
        self._task = asyncio.create_task(self._run(), name=f"batcher-{client.endpoint}")
        self.in_flight_items = 0
        #: Items sent and calls made, for the load estimate and tests.
        self.items_sent = 0
        self.calls_made = 0
        self._depth = metrics.VERIFY_QUEUE_DEPTH.labels(target=client.endpoint)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def submit(self, item: target_pb2.VerifyItem) -> BatchedResult:
        """Queue ``item``; resolves when its batch returns (raises when the whole call failed)."""
        if self._closed:
            raise RuntimeError("the batcher is closed")
        future: asyncio.Future[BatchedResult] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(item, future, time.perf_counter_ns(), current_request_id()))
        self._depth.set(len(self._queue))
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._slots.acquire()
                if len(self._queue) < self.max_batch_size and self.max_wait_s > 0:
                    await self._wait_for_more()
                batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
                self._depth.set(len(self._queue))
                batch = [p for p in batch if not p.future.done()]  # cancelled while queued
                if not batch:
                    self._slots.release()
                    continue
                self.in_flight_items += len(batch)
                task = asyncio.create_task(self._call(batch))
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

    async def _call(self, batch: list[_Pending]) -> None:
        # This task's own context: the Verify call carries the request ids of its items.
        ids = dict.fromkeys(p.request_id for p in batch if p.request_id)
        structlog.contextvars.bind_contextvars(request_id=",".join(ids) or None)
        sent_ns = time.perf_counter_ns()
        try:
            reply: VerifyReply = await self.client.verify([p.item for p in batch])
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self.in_flight_items -= len(batch)
            self._slots.release()
            self.calls_made += 1
            self.items_sent += len(batch)
            if self._queue:
                self._wakeup.set()
        call_ns = time.perf_counter_ns() - sent_ns
        if self._on_call is not None:
            try:
                self._on_call(
                    batch_size=len(batch),
                    positions=reply.positions_processed,
                    verify_ns=reply.verify_ns,
                    call_ns=call_ns,
                    tokens=sum(len(p.item.proposal.distributions) for p in batch),
                )
            except Exception:  # statistics must never fail a batch
                log.exception("batch_observer_failed")
        for p, result in zip(batch, reply.results, strict=True):
            if not p.future.done():
                p.future.set_result(
                    BatchedResult(
                        item=result,
                        queue_ns=sent_ns - p.submitted_ns,
                        call_ns=call_ns,
                        verify_ns=reply.verify_ns,
                        batch_size=len(batch),
                        positions_processed=reply.positions_processed,
                    )
                )

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
        self._depth.set(0)
