"""Admission: how many sessions a coordinator runs, in total and per client, and how fast a client
starts them.

``admission.admit(client, n)`` takes ``n`` session places at once, before any work is done on the
request (no tokenizing, no constraint compile, no prefill): a request over ``max_sessions`` in total,
or over ``max_sessions_per_client`` for its client, or beyond its client's rate of new sessions (a
token bucket per client: ``session_burst_per_client`` at once, refilled at
``session_rate_per_client`` per second), is refused with RESOURCE_EXHAUSTED and a retry hint, and
nothing of it is held. Otherwise each :class:`Place` is held (and its rate token spent) from then
until its session ends or the request fails; :meth:`Place.release` gives it back, once.
``client`` is an identity from :class:`specserve.coordinator.clients.ClientKeys`; None (a caller the server
has no name for) is limited only by ``max_sessions``. :meth:`Admission.idle` returns once no place
is held (a drain). docs/operations.md, "Limits".
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from specserve.api import errors
from specserve.runtime import metrics

#: The retry hint sent with RESOURCE_EXHAUSTED when a concurrency limit is reached.
SESSION_LIMIT_RETRY_AFTER_S = 1.0
#: The shortest retry hint: a hint is never 0 (a client would retry at once and be refused again).
MIN_RETRY_AFTER_S = 0.001

#: Buckets kept before the full ones (clients idle long enough to have refilled) are dropped.
_MAX_IDLE_BUCKETS = 4096


def retry_hint_s(wait_s: float) -> float:
    """A wait as a retry hint: rounded up to the millisecond, at least :data:`MIN_RETRY_AFTER_S`."""
    return max(MIN_RETRY_AFTER_S, math.ceil(round(wait_s * 1000, 6)) / 1000)


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.3f} s"


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
        """Seconds until ``sessions`` more may start for ``client`` (0: now; inf: never, more than the burst)."""
        if sessions > self.burst:
            return math.inf
        missing = sessions - self._tokens(client, self._clock())
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, client: str, sessions: int = 1) -> None:
        """Count ``sessions`` new sessions of ``client`` (after :meth:`wait_s` said 0)."""
        now = self._clock()
        self._buckets[client] = (self._tokens(client, now) - sessions, now)
        if len(self._buckets) > _MAX_IDLE_BUCKETS:
            self._buckets = {c: b for c, b in self._buckets.items() if self._tokens(c, now) < self.burst}


class Place:
    """One session's place under the limits, held from admission until :meth:`release` (idempotent).

    A context manager: leaving the block releases it.
    """

    __slots__ = ("_admission", "_client", "_held")

    def __init__(self, admission: Admission, client: str | None) -> None:
        self._admission, self._client, self._held = admission, client, True

    @property
    def client(self) -> str | None:
        """The client this place was admitted for (None: limited by ``max_sessions`` only)."""
        return self._client

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release(self._client)

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


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
        """Places held now (sessions running, and requests admitted that are being prepared)."""
        return self._active

    async def idle(self) -> None:
        """Return once no place is held."""
        await self._idle.wait()

    def admit(self, client: str | None, sessions: int = 1) -> list[Place]:
        """``sessions`` places for ``client``, all or none: ResourceExhausted (with a retry hint, never 0)
        when one would pass a limit; otherwise their rate tokens are spent and the places held."""
        self._refuse_past_limits(client, sessions)
        if client is not None and self.rate is not None:
            self.rate.take(client, sessions)
        self._active += sessions
        if client is not None:
            self._per_client[client] = self._per_client.get(client, 0) + sessions
        self._idle.clear()
        metrics.ACTIVE_SESSIONS.inc(sessions)
        return [Place(self, client) for _ in range(sessions)]

    def _release(self, client: str | None) -> None:
        self._active -= 1
        if client is not None:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
        if self._active == 0:
            self._idle.set()
        metrics.ACTIVE_SESSIONS.dec()

    def _refuse_past_limits(self, client: str | None, sessions: int) -> None:
        if self._active + sessions > self.max_sessions:
            raise _exhausted(
                f"the coordinator is running its maximum of {self.max_sessions} sessions; retry shortly",
                SESSION_LIMIT_RETRY_AFTER_S,
            )
        limit = self.max_sessions_per_client
        if client is not None and self._per_client.get(client, 0) + sessions > limit:
            raise _exhausted(
                f"this client already runs its maximum of {limit} concurrent sessions; "
                "wait for one to finish and retry",
                SESSION_LIMIT_RETRY_AFTER_S,
            )
        if client is not None and self.rate is not None:
            wait_s = self.rate.wait_s(client, sessions)
            if math.isinf(wait_s):
                raise errors.InvalidArgument(
                    f"{sessions} sessions at once is more than this server's burst of {self.rate.burst} new "
                    "sessions per client; ask for fewer"
                )
            if wait_s > 0:
                hint = retry_hint_s(wait_s)
                raise _exhausted(
                    f"this client starts new sessions faster than this server's limit of "
                    f"{self.rate.rate:g} per second (bursts of up to {self.rate.burst}); retry in "
                    f"{_duration(hint)}",
                    hint,
                )


def _exhausted(message: str, retry_after_s: float) -> errors.ResourceExhausted:
    metrics.REQUESTS.labels(status="resource_exhausted").inc()
    return errors.ResourceExhausted(message, retry_after_s=retry_after_s)
