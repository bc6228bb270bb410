"""The coordinator's view of its workers: clients, batchers, replica health and load.

One :class:`WorkerPool` per coordinator. It owns a :class:`DraftClient` per
draft endpoint, a :class:`TargetClient` and a :class:`VerifyBatcher` per target
endpoint, the :class:`ReplicaSet` of each tier (consistent hashing and circuit
breakers), and reports each Verify call to the shared cost model once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from coordinator.batcher import VerifyBatcher
from coordinator.policy import CostModel, LoadSnapshot
from coordinator.routing import ReplicaSet
from coordinator.workers import DraftClient, TargetClient
from specserve import metrics
from specserve.config import CoordinatorSettings

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class BreakerSettings:
    """Back-off of a tier's circuit breakers, in seconds."""

    base_s: float = 1.0
    max_s: float = 30.0


class WorkerPool:
    """Clients, batchers and health of every draft and target replica."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        cost_model: CostModel,
        *,
        draft_breaker: BreakerSettings = BreakerSettings(),
        target_breaker: BreakerSettings = BreakerSettings(base_s=0.5, max_s=10.0),
        max_in_flight: int = 1,
    ) -> None:
        if not settings.target_endpoints:
            raise ValueError("the coordinator needs at least one target endpoint (target_endpoints)")
        self.settings = settings
        self.cost_model = cost_model
        self.drafts = ReplicaSet(
            settings.draft_endpoints,
            base_backoff_s=draft_breaker.base_s,
            max_backoff_s=draft_breaker.max_s,
            name="draft",
        )
        self.targets = ReplicaSet(
            settings.target_endpoints,
            base_backoff_s=target_breaker.base_s,
            max_backoff_s=target_breaker.max_s,
            name="target",
        )
        self.draft_clients = {ep: DraftClient(ep, settings) for ep in settings.draft_endpoints}
        self.target_clients = {ep: TargetClient(ep, settings) for ep in settings.target_endpoints}
        self.batchers = {
            ep: VerifyBatcher(
                client,
                max_batch_size=settings.max_batch_size,
                max_wait_s=settings.max_batch_wait_ms / 1000.0,
                max_in_flight=max_in_flight,
                on_call=self._observe_call,
                expected=lambda ep=ep: self._expected(ep),
            )
            for ep, client in self.target_clients.items()
        }
        self.active_sessions = 0
        #: Which target each active session's next Verify item goes to, and the count per target.
        self._assigned: dict[str, str] = {}
        self._per_target = dict.fromkeys(settings.target_endpoints, 0)
        self._recent_batch = 1.0  # decaying mean Verify batch size

    def _observe_call(
        self, *, batch_size: int, positions: int, verify_ns: int, call_ns: int, tokens: int
    ) -> None:
        if positions >= batch_size:
            self.cost_model.observe_verify(batch_size=batch_size, positions=positions, ns=verify_ns)
        self.cost_model.observe_rtt(ns=call_ns - verify_ns, tokens=tokens // max(batch_size, 1))
        self._recent_batch = 0.9 * self._recent_batch + 0.1 * batch_size
        metrics.VERIFY_BATCH_SIZE.observe(batch_size)

    def assign(self, session_id: str, endpoint: str | None) -> None:
        """Record that ``session_id``'s next Verify item goes to ``endpoint`` (None: the session ended)."""
        old = self._assigned.pop(session_id, None)
        if old is not None:
            self._per_target[old] -= 1
        if endpoint is not None:
            self._assigned[session_id] = endpoint
            self._per_target[endpoint] += 1

    def _expected(self, endpoint: str) -> int:
        """Sessions bound to ``endpoint`` that are not in its batcher yet (drafting, or streaming)."""
        batcher = self.batchers[endpoint]
        return self._per_target[endpoint] - batcher.queued - batcher.in_flight_items

    def load(self) -> LoadSnapshot:
        """How busy the target tier is now (for the policy)."""
        queued = sum(b.queued for b in self.batchers.values())
        occupancy = min(1.0, self._recent_batch / self.settings.max_batch_size)
        return LoadSnapshot(
            active_sessions=max(1, self.active_sessions), batch_occupancy=occupancy, verify_queue_depth=queued
        )

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.batchers.values()), return_exceptions=True)
        clients = [*self.draft_clients.values(), *self.target_clients.values()]
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
