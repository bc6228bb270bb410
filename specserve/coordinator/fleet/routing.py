"""Where a session's work goes: consistent hashing over replicas, failure marking, back-off.

Sessions are sticky to a target replica (their KV cache lives there) and, for
the same reason, to a draft replica. :class:`HashRing` maps a key to an
ordered list of endpoints (its preference list); :class:`ReplicaSet` walks that
list and skips replicas marked down.

The key is the session's prompt prefix within its cache scope (:func:`prefix_key`:
its first tokens and its tenant's scope), so the turns of one conversation, which
each resend the history, go where the earlier turns left their prefix cache
(docs/design.md, "Routing by prefix"), and one tenant's prompts are placed
independently of another's.
:meth:`ReplicaSet.order` bounds the load (Mirrokni et al., "Consistent hashing
with bounded loads", 2018): a replica that already holds more than its share of
this coordinator's sessions (beyond an absolute slack) is passed over for the next of the key's list, so
a prompt prefix many sessions share (a system prompt) does not pile them on one
replica. Coordinators agree without talking: the ring is a function of the
endpoints and the key alone; only the load bound reads local counts. A replica marked down stays skipped for a
back-off period, after which it is tried again; the back-off doubles on each
consecutive failure up to a cap (a simple circuit breaker). Removing one of n
replicas moves only the sessions that lived on it (consistent hashing).

Clock-injectable and free of I/O, so it is tested without servers.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def prefix_key(token_ids: Sequence[int], tokens: int, scope: bytes = b"") -> str | None:
    """The routing key of a prompt: a hash of its session's cache ``scope`` (specserve/coordinator/cache_scope.py)
    and its first ``tokens`` token ids (all of them when shorter); None when ``tokens`` is 0 (route by
    session id)."""
    if tokens <= 0:
        return None
    head = scope.hex() + ":" + ",".join(str(int(t)) for t in token_ids[:tokens])
    return "prefix:" + hashlib.blake2b(head.encode(), digest_size=16).hexdigest()


class HashRing:
    """A consistent-hash ring with ``vnodes`` virtual nodes per endpoint."""

    def __init__(self, endpoints: Sequence[str], *, vnodes: int = 64) -> None:
        if not endpoints:
            raise ValueError("a hash ring needs at least one endpoint")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"endpoints must be distinct, got {list(endpoints)}")
        self.endpoints = tuple(endpoints)
        points = sorted((_hash(f"{ep}#{i}"), ep) for ep in self.endpoints for i in range(vnodes))
        self._keys = [h for h, _ in points]
        self._owners = [ep for _, ep in points]

    def preference(self, key: str) -> list[str]:
        """Every endpoint, in the order ``key`` should try them (first = its home)."""
        start = bisect.bisect(self._keys, _hash(key))
        order: list[str] = []
        for i in range(len(self._owners)):
            ep = self._owners[(start + i) % len(self._owners)]
            if ep not in order:
                order.append(ep)
                if len(order) == len(self.endpoints):
                    break
        return order


@dataclass
class _Health:
    failures: int = 0
    down_until: float = 0.0


class ReplicaSet:
    """Endpoints of one tier with per-endpoint circuit breakers.

    ``choose(key)`` is the first healthy endpoint of ``key``'s preference list,
    or None when all are backing off. ``mark_failed`` opens an endpoint's
    breaker for ``base_backoff_s * 2**(failures-1)`` (capped at ``max_backoff_s``);
    ``mark_ok`` closes it.
    """

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
        self._ring = HashRing(endpoints) if endpoints else None
        self._health = {ep: _Health() for ep in endpoints}
        self._base = base_backoff_s
        self._max = max_backoff_s
        self._clock = clock

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._ring.endpoints if self._ring else ()

    def is_up(self, endpoint: str) -> bool:
        return self._health[endpoint].down_until <= self._clock()

    def failures(self, endpoint: str) -> int:
        """Consecutive failures of ``endpoint`` since it last answered."""
        return self._health[endpoint].failures

    def choose(self, key: str) -> str | None:
        """The first endpoint of ``key``'s preference list that is not backing off."""
        if self._ring is None:
            return None
        return self.first_up(self._ring.preference(key))

    def first_up(self, order: Sequence[str]) -> str | None:
        """The first endpoint of ``order`` that is not backing off."""
        for ep in order:
            if self.is_up(ep):
                return ep
        return None

    def order(self, key: str, loads: Mapping[str, int], *, factor: float, slack: int = 0) -> tuple[str, ...]:
        """``key``'s preference list with the first endpoint that is up and under the load bound moved to
        the front: ``loads[ep]`` sessions already there, bound ``ceil(factor * (sum + 1) / up) + slack``
        (``slack``: an absolute imbalance tolerated first, as the SGLang router's ``balance_abs_threshold``)."""
        if self._ring is None:
            return ()
        preference = self._ring.preference(key)
        up = [ep for ep in preference if self.is_up(ep)]
        if not up:
            return tuple(preference)
        bound = math.ceil(factor * (sum(loads.get(ep, 0) for ep in up) + 1) / len(up)) + slack
        home = next((ep for ep in up if loads.get(ep, 0) < bound), up[0])
        return (home, *(ep for ep in preference if ep != home))

    def mark_failed(self, endpoint: str) -> float:
        """Open ``endpoint``'s breaker; returns the back-off in seconds."""
        health = self._health[endpoint]
        health.failures += 1
        backoff = min(self._max, self._base * 2 ** (health.failures - 1))
        health.down_until = self._clock() + backoff
        log.warning(
            f"{self.name}_marked_down", endpoint=endpoint, backoff_s=backoff, failures=health.failures
        )
        return backoff

    def mark_ok(self, endpoint: str) -> None:
        health = self._health[endpoint]
        if health.failures:
            log.info(f"{self.name}_recovered", endpoint=endpoint)
        health.failures = 0
        health.down_until = 0.0
