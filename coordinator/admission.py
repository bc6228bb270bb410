"""Admission: how many sessions a coordinator runs, in total and per client, and how fast a client
starts them.

``async with admission.slot(client):`` holds one session's place for the body
of the block. A session over ``max_sessions`` in total, or over
``max_sessions_per_client`` for its client (an identity from
:func:`specserve.runtime.interceptors.client_identity`; None is not limited per
client), or beyond its client's rate of new sessions (a token bucket per client:
``session_burst_per_client`` at once, refilled at ``session_rate_per_client`` per
second), is refused with RESOURCE_EXHAUSTED and a retry hint before anything
starts. :meth:`Admission.idle` returns once no slot is held (a drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable

from specserve.api import errors
from specserve.runtime import metrics

#: The retry hint sent with RESOURCE_EXHAUSTED when a session limit is reached.
SESSION_LIMIT_RETRY_AFTER_S = 1.0


#: Buckets kept before the full ones (clients idle long enough to have refilled) are dropped.
_MAX_IDLE_BUCKETS = 4096


class SessionRate:
    """Token buckets of new sessions, one per client: ``burst`` at once, ``rate`` more per second."""

    def __init__(self, *, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not (rate > 0 and math.isfinite(rate)) or burst < 1:
            raise ValueError("the session rate must be a finite number > 0 and the burst >= 1")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def _tokens(self, client: str, now: float) -> float:
        tokens, at = self._buckets.get(client, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.rate)

    def wait_s(self, client: str, sessions: int = 1) -> float:
        """Seconds until ``sessions`` more may start for ``client`` (0: now)."""
        missing = sessions - self._tokens(client, self._clock())
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, client: str) -> None:
        """Count one new session of ``client`` (after :meth:`wait_s` said 0)."""
        now = self._clock()
        self._buckets[client] = (self._tokens(client, now) - 1.0, now)
        if len(self._buckets) > _MAX_IDLE_BUCKETS:
            self._buckets = {c: b for c, b in self._buckets.items() if self._tokens(c, now) < self.burst}


class Admission:
    """Session limits of one coordinator; see the module docstring."""

    def __init__(
        self,
        *,
        max_sessions: int,
        max_sessions_per_client: int,
        rate: SessionRate | None = None,
    ) -> None:
        if max_sessions < 1 or max_sessions_per_client < 1:
            raise ValueError("max_sessions and max_sessions_per_client must be >= 1")
        self.max_sessions = max_sessions
        self.max_sessions_per_client = max_sessions_per_client
        self.rate = rate
        self._active = 0
        self._per_client: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def active(self) -> int:
        """Slots held now."""
        return self._active

    @contextlib.asynccontextmanager
    async def slot(self, client: str | None) -> AsyncIterator[None]:
        """Hold one session's place while the block runs; refuses one over a limit (ResourceExhausted)."""
        self._admit(client)
        self._active += 1
        if client is not None:
            self._per_client[client] = self._per_client.get(client, 0) + 1
            if self.rate is not None:
                self.rate.take(client)
        self._idle.clear()
        metrics.ACTIVE_SESSIONS.inc()
        try:
            yield
        finally:
            self._active -= 1
            if client is not None:
                self._per_client[client] -= 1
                if not self._per_client[client]:
                    del self._per_client[client]
            if self._active == 0:
                self._idle.set()
            metrics.ACTIVE_SESSIONS.dec()

    async def idle(self) -> None:
        """Return once no slot is held."""
        await self._idle.wait()

    def check(self, client: str | None, sessions: int = 1) -> None:
        """Refuse (ResourceExhausted) unless ``sessions`` more slots fit the limits now.

        :meth:`slot` checks one; a caller about to start several at once (the HTTP
        API's ``n``) checks them all first, so that none starts when one would be refused.
        """
        self._admit(client, sessions)

    def _admit(self, client: str | None, sessions: int = 1) -> None:
        if self._active + sessions > self.max_sessions:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            raise errors.ResourceExhausted(
                f"the coordinator is running its maximum of {self.max_sessions} sessions; retry shortly",
                retry_after_s=SESSION_LIMIT_RETRY_AFTER_S,
            )
        limit = self.max_sessions_per_client
        if client is not None and self._per_client.get(client, 0) + sessions > limit:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            raise errors.ResourceExhausted(
                f"this client already runs its maximum of {limit} concurrent sessions; "
                "wait for one to finish and retry",
                retry_after_s=SESSION_LIMIT_RETRY_AFTER_S,
            )
        if client is not None and self.rate is not None:
            wait_s = self.rate.wait_s(client, sessions)
            if wait_s > 0:
                metrics.REQUESTS.labels(status="resource_exhausted").inc()
                raise errors.ResourceExhausted(
                    f"this client starts new sessions faster than this server's limit of "
                    f"{self.rate.rate:g} per second (bursts of up to {self.rate.burst}); retry in "
                    f"{wait_s:.1f} s",
                    retry_after_s=wait_s,
                )
