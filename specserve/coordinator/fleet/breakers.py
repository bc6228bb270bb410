"""Circuit breakers: which replicas a call may go to now, and the one rule for what opens a breaker.

A failed call counts against its replica only when it is a replica fault (:func:`is_replica_fault`: down, past its
deadline, a worker bug), in either tier; a request's own INVALID_ARGUMENT, FAILED_PRECONDITION or
RESOURCE_EXHAUSTED never does. :meth:`Breakers.fault` opens the breaker once per failed call (a Verify or
ProposeBatch of several sessions: the others find it open already). An open breaker backs off
``base_backoff_s * 2**(failures - 1)``, capped at ``max_backoff_s``, then lets a call through again; an answer
closes it. Clock-injectable and free of I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from specserve.api import errors
from specserve.runtime import metrics

log = structlog.get_logger(__name__)

#: Errors that say the replica, not the request, failed: the same call may succeed on another replica.
REPLICA_FAULTS: tuple[type[errors.SpecServeError], ...] = (
    errors.Unavailable,  # WorkerError (INTERNAL, UNKNOWN, a malformed reply) included
    errors.DeadlineExceeded,
    errors.Cancelled,
)


def is_replica_fault(exc: BaseException) -> bool:
    """Whether a failed call is the replica's fault (down, hung, broken), not the request's."""
    return isinstance(exc, REPLICA_FAULTS)


@dataclass
class _Health:
    failures: int = 0
    down_until: float = 0.0


class Breakers:
    """One breaker per endpoint of a tier (``name``: the tier, in logs and metrics)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "replica",
    ) -> None:
        if base_backoff_s <= 0 or max_backoff_s < base_backoff_s:
            raise ValueError("need 0 < base_backoff_s <= max_backoff_s")
        self.name = name
        self._health = {ep: _Health() for ep in endpoints}
        self._base = base_backoff_s
        self._max = max_backoff_s
        self._clock = clock

    def is_up(self, endpoint: str) -> bool:
        return self._health[endpoint].down_until <= self._clock()

    def failures(self, endpoint: str) -> int:
        """Consecutive failures of ``endpoint`` since it last answered."""
        return self._health[endpoint].failures

    def first_up(self, order: Sequence[str]) -> str | None:
        """The first endpoint of ``order`` that is not backing off."""
        return next((ep for ep in order if self.is_up(ep)), None)

    def fault(self, endpoint: str, exc: BaseException) -> float | None:
        """The one rule (module docstring): the back-off when the failure counts against ``endpoint`` (0 when its
        breaker is open already), None when it is the request's own."""
        if not is_replica_fault(exc):
            return None
        if not self.is_up(endpoint):
            return 0.0
        metrics.REPLICA_FAILURES.labels(tier=self.name).inc()
        return self.mark_failed(endpoint)

    def mark_failed(self, endpoint: str) -> float:
        """Open ``endpoint``'s breaker; returns the back-off in seconds."""
        health = self._health[endpoint]
        health.failures += 1
        backoff = min(self._max, self._base * 2 ** (health.failures - 1))
        health.down_until = self._clock() + backoff
        log.warning(f"{self.name}_marked_down", endpoint=endpoint, backoff_s=backoff, failures=health.failures)
        return backoff

    def mark_ok(self, endpoint: str) -> None:
        health = self._health[endpoint]
        if health.failures:
            log.info(f"{self.name}_recovered", endpoint=endpoint)
        health.failures = 0
        health.down_until = 0.0
