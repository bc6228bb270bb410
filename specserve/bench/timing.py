"""The one timer of the benchmarks: a stopwatch, interleaved laps with the warm-up left out, and a request
through the service timed from the client's side.

Every figure in docs/benchmarks is timed by one of these (the in-process passes of
:mod:`specserve.bench.costs` and the cards, and the generations through the service of the harness's modes).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import AsyncIterable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class Stopwatch:
    """``with Stopwatch() as sw: ...``, then ``sw.seconds``; ``sw.elapsed()`` reads it while it runs.
    ``clock``: nanoseconds (``time.perf_counter_ns``, or ``time.thread_time_ns`` for CPU time)."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.start: int | None = None
        self.seconds = float("nan")

    def elapsed(self) -> float:
        """Seconds since the ``with`` block began."""
        if self.start is None:
            raise RuntimeError("the stopwatch has not started: use it in a with block")
        return (self.clock() - self.start) / 1e9

    def __enter__(self) -> Stopwatch:
        self.start = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()


class Laps:
    """Named timings of steps run in turns, the first ``warmup`` turns run but not kept::

        laps = Laps(warmup=3)
        for _ in laps.rounds(steps):
            with laps.time("draft"):
                ...
        laps.median_ms("draft")
    """

    def __init__(self, warmup: int = 0, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.warmup, self.clock = warmup, clock
        self.seconds: dict[str, list[float]] = {}
        self._keep = True

    def rounds(self, n: int) -> Iterator[int]:
        """``n + warmup`` turns, numbered from 0; what :meth:`time` takes in the first ``warmup`` is dropped."""
        for i in range(n + self.warmup):
            self._keep = i >= self.warmup
            yield i

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block under ``name`` (kept only outside the warm-up turns)."""
        with Stopwatch(self.clock) as sw:
            yield
        if self._keep:
            self.seconds.setdefault(name, []).append(sw.seconds)

    def median_ms(self, name: str) -> float:
        return 1000.0 * statistics.median(self.seconds[name])


@dataclass
class Streamed:
    """A generation streamed through the service, as the client saw it: the tokens, the seconds from the
    request to the last chunk, and each chunk's (arrival seconds, tokens in it); ``stats``: the server's
    ``GenerationStats``."""

    token_ids: list[int]
    seconds: float
    stamps: list[tuple[float, int]] = field(default_factory=list)
    stats: Any = None

    @property
    def first_token_s(self) -> float:
        return self.stamps[0][0] if self.stamps else float("nan")


def inter_token_latencies(stamps: list[tuple[float, int]]) -> list[float]:
    """Inter-token latency as a reader sees it, from a stream's ``(arrival seconds, tokens)`` chunks: each
    chunk's gap since the previous chunk, spread over the chunk's tokens (one figure per token after the
    first chunk)."""
    return [(b - a) / n for (a, _), (b, n) in itertools.pairwise(stamps) for _ in range(n)]


async def timed_stream(stream: Any) -> Streamed:
    """Read ``stream`` (``AsyncClient.stream``'s) to its end, timing each chunk from now."""
    stamps: list[tuple[float, int]] = []
    tokens: list[int] = []
    chunks: AsyncIterable[Any] = stream
    with Stopwatch() as sw:
        async for chunk in chunks:
            if chunk.token_ids:
                stamps.append((sw.elapsed(), len(chunk.token_ids)))
                tokens.extend(chunk.token_ids)
    return Streamed(tokens, sw.seconds, stamps, stream.stats)


async def timed_generate(client: Any, **request: Any) -> tuple[Any, float]:
    """``client.generate(**request)`` (an ``AsyncClient``) and the seconds it took."""
    with Stopwatch() as sw:
        result = await client.generate(**request)
    return result, sw.seconds
