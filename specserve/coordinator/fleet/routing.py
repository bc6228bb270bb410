"""Where a session's work goes: consistent hashing over replicas, bounded load, each replica behind its
breaker.

Sessions are sticky to a target and a draft replica (their caches live there). :func:`prefix_key` keys a
session by its cache scope and its prompt's first tokens, :class:`HashRing` maps the key to a preference list,
:meth:`ReplicaSet.order` puts the load-bounded home first and :class:`Routes` fixes each session's order when
it first asks (docs/design.md, "Routing by prefix"). Clock-injectable and free of I/O, so it is tested without
servers.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specserve.coordinator.fleet.breakers import Breakers


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


class ReplicaSet(Breakers):
    """The endpoints of one tier in the order a key tries them, each behind its breaker
    (:class:`~specserve.coordinator.fleet.breakers.Breakers`)."""

    def __init__(self, endpoints: Sequence[str], **breakers: Any) -> None:
        """``breakers``: the :class:`Breakers` settings (``base_backoff_s``, ``max_backoff_s``, ``clock``, ``name``)."""
        super().__init__(endpoints, **breakers)
        self._ring = HashRing(endpoints) if endpoints else None

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._ring.endpoints if self._ring else ()

    def choose(self, key: str) -> str | None:
        """The first endpoint of ``key``'s preference list that is not backing off."""
        if self._ring is None:
            return None
        return self.first_up(self._ring.preference(key))

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


@dataclass
class Route:
    """One session's replica orders (the first of each: its home), fixed when it first asks."""

    targets: tuple[str, ...]
    drafts: tuple[str, ...]
    homed: bool = True  # counted in the load of its homes


class Routes:
    """Every session's :class:`Route`, and how many sessions each replica is home to (the load routing bounds)."""

    def __init__(self, targets: ReplicaSet, drafts: ReplicaSet, *, prefix_tokens: int, factor: float, slack: int) -> None:
        self.targets, self.drafts = targets, drafts
        self.prefix_tokens, self.factor, self.slack = prefix_tokens, factor, slack
        self._routes: dict[str, Route] = {}
        self._homes: dict[str, int] = dict.fromkeys([*targets.endpoints, *drafts.endpoints], 0)

    def route(self, session_id: str, prompt: Sequence[int], scope: bytes) -> Route:
        """The session's route: on first use the replicas its prompt's first tokens hash to within its cache
        ``scope`` (its id where ``prefix_tokens`` is 0), load bounded."""
        route = self._routes.get(session_id)
        if route is None:
            key = prefix_key(prompt, self.prefix_tokens, scope) or session_id
            route = Route(
                self.targets.order(key, self._homes, factor=self.factor, slack=self.slack),
                self.drafts.order(key, self._homes, factor=self.factor, slack=self.slack),
            )
            self._count(route, +1)
            self._routes[session_id] = route
        return route

    def get(self, session_id: str) -> Route | None:
        return self._routes.get(session_id)

    def leave(self, session_id: str) -> None:
        """The session starts no more rounds: it stops counting in its homes' load (its route stays)."""
        route = self._routes.get(session_id)
        if route is not None and route.homed:
            route.homed = False
            self._count(route, -1)

    def drop(self, session_id: str) -> None:
        self.leave(session_id)
        self._routes.pop(session_id, None)

    def _count(self, route: Route, step: int) -> None:
        for order in (route.targets, route.drafts):
            if order:
                self._homes[order[0]] += step
