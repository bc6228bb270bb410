"""The sessions of one HTTP request (its ``n`` choices), run side by side.

:class:`Choices` runs one ``Coordinator.generate`` per choice, each in its own
task and in its own admission place (released when its task ends, however it ends), and merges their events in arrival order. :meth:`Choices.first_events`
waits until every choice has produced its first event, so that an error before
any token (a refused session, no target reachable) can still become the HTTP
status of the reply. :meth:`Choices.cancel` cancels every session that is
still running: each one's ``generate`` then ends as cancelled and releases its
caches on the workers, exactly as when a gRPC client cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from specserve.coordinator.admission import Place
from specserve.coordinator.cache_scope import ANONYMOUS
from specserve.coordinator.coordinator import Chunk, Coordinator, Finished
from specserve.coordinator.requests import GenerationRequest

Event = Chunk | Finished
_END = object()


class Choices:
    """``n`` sessions of one request; events come out as ``(choice index, event or exception)``."""

    def __init__(
        self,
        coordinator: Coordinator,
        requests: Sequence[GenerationRequest],
        places: Sequence[Place],
        *,
        tenant: str = ANONYMOUS,
    ) -> None:
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._open = len(requests)
        self._buffer: list[tuple[int, Event | BaseException]] = []
        self._tasks = []
        for i, (request, place) in enumerate(zip(requests, places, strict=True)):
            task = asyncio.ensure_future(self._run(i, coordinator.generate(request, place, tenant=tenant)))
            task.add_done_callback(lambda _, place=place: place.release())  # also when cancelled unstarted
            self._tasks.append(task)

    async def _run(self, index: int, events: AsyncIterator[Event]) -> None:
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    self._queue.put_nowait((index, event))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        self._queue.put_nowait((index, _END))

    async def first_events(self) -> None:
        """Wait until every choice has an event (or ended); raise the first error among them."""
        waiting = set(range(len(self._tasks)))
        while waiting:
            index, item = await self._queue.get()
            waiting.discard(index)
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.cancel()
                raise item
            self._buffer.append((index, item))  # type: ignore[arg-type]

    async def events(self) -> AsyncIterator[tuple[int, Event | BaseException]]:
        """Every event (those :meth:`first_events` held first), until every choice has ended."""
        while self._buffer:
            yield self._buffer.pop(0)
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
            else:
                yield index, item  # type: ignore[misc]

    def cancel(self) -> None:
        """Cancel every session still running (each releases its caches); returns at once."""
        for task in self._tasks:
            task.cancel()
