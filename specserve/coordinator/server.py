"""Building and running the coordinator.

:func:`start_coordinator` probes the workers it can reach
(:func:`~specserve.coordinator.fleet.limits.probe_limits`: a draft whose vocabulary differs
from the target's is refused), then wires the Redis store, the worker pool
(clients, batchers, replica health), the cost model and policy, the tokenizer
and the servicer once, from one :class:`~specserve.runtime.config.CoordinatorSettings`
and the probed limits, and starts the gRPC server and, when ``http_port`` is set, the
OpenAI-compatible HTTP API on the same ``Coordinator`` (:mod:`specserve.coordinator.http_api`);
:func:`serve` runs it until SIGTERM / SIGINT (the CLI's entry point): health
NOT_SERVING, drain the sessions, stop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog

from specserve.coordinator.coordinator import Coordinator
from specserve.coordinator.fleet.clients import WorkerClients
from specserve.coordinator.fleet.limits import probe_limits
from specserve.coordinator.fleet.pool import WorkerPool
from specserve.coordinator.servicer import CoordinatorServicer
from specserve.coordinator.speculation.cost_model import CostModel, CostPrior
from specserve.coordinator.speculation.policy import AdaptiveGamma
from specserve.coordinator.speculation.sources import check_opt_in
from specserve.engine.models import resolve_model_path
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.interceptors import BearerTokenInterceptor
from specserve.runtime.server import (
    Registration,
    RunningServer,
    create_server,
    run_role,
)
from specserve.runtime.store import SessionStore
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name


@dataclass
class CoordinatorApp:
    """A running coordinator: its domain service and its server."""

    settings: CoordinatorSettings
    coordinator: Coordinator
    running: RunningServer
    #: The OpenAI-compatible HTTP API (``specserve.coordinator.http_server.HttpServer``), when ``http_port`` is set.
    http: Any = None

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace: float | None = None) -> None:
        grace = self.settings.shutdown_grace_s if grace is None else grace
        stops = [self.running.stop(grace)] + ([self.http.stop(grace)] if self.http is not None else [])
        await asyncio.gather(*stops)
        await self.coordinator.close()


def load_tokenizer(settings: CoordinatorSettings) -> Any:
    """The target's tokenizer (settings.tokenizer, or the default target's)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    spec = resolve_model_path(settings.tokenizer, "target")
    return AutoTokenizer.from_pretrained(spec, local_files_only=Path(spec).is_dir())


async def build_coordinator(
    settings: CoordinatorSettings, *, tokenizer: Any = None, store: SessionStore | None = None
) -> Coordinator:
    """Wire a coordinator from ``settings``: probe the workers it reaches, then build its parts once."""
    check_opt_in(settings.opt_in_sources)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings)
    store = store or SessionStore.from_url(settings.redis_url.get_secret_value())
    clients = WorkerClients.connect(settings)
    try:
        limits = await probe_limits(settings, clients, tokenizer)
    except BaseException:
        await clients.close()
        raise
    cost_model = CostModel(prior=CostPrior(verify_curve=limits.verify_curve_ns))
    pool = WorkerPool(
        settings,
        cost_model,
        clients,
        max_batch_size=limits.max_batch_size,
        draft_max_batch_size=limits.draft_max_batch_size,
    )
    adaptive = AdaptiveGamma.up_to(
        cost_model,
        limits.max_gamma,
        max_batch_size=settings.max_batch_size,
        decode_steps=settings.decode_steps,
    )
    return Coordinator(
        settings, store=store, pool=pool, adaptive=adaptive, tokenizer=tokenizer, limits=limits
    )


async def start_coordinator(
    settings: CoordinatorSettings, *, tokenizer: Any = None, store: SessionStore | None = None
) -> CoordinatorApp:
    """Build a coordinator and start its gRPC server on ``settings.host:settings.port``."""
    coordinator = await build_coordinator(settings, tokenizer=tokenizer, store=store)
    interceptors = []
    if settings.auth_tokens:
        interceptors.append(BearerTokenInterceptor([t.get_secret_value() for t in settings.auth_tokens]))
    try:
        running = await create_server(
            settings,
            [
                Registration(
                    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                    CoordinatorServicer(coordinator),
                    SERVICE_NAME,
                )
            ],
            interceptors=interceptors,
            drain=coordinator.drain,
            stream_idle_timeout_s=settings.stream_idle_timeout_s,
        )
    except BaseException:
        await coordinator.close()
        raise
    http = None
    if settings.http_port is not None:
        from specserve.coordinator.http_server import start_http  # FastAPI and uvicorn only when asked for

        try:
            http = await start_http(coordinator, settings)
        except BaseException:
            await running.stop(0)
            await coordinator.close()
            raise
        running.drain = _drain_both(http, coordinator)
    log.info(
        "coordinator_started",
        port=running.port,
        http_port=None if http is None else http.port,
        targets=settings.target_endpoints,
        drafts=settings.draft_endpoints,
        max_gamma=coordinator.max_gamma,
        max_batch_size=settings.max_batch_size,
        max_batch_wait_ms=settings.max_batch_wait_ms,
        draft_max_batch_size=coordinator.pool.draft_max_batch_size,
    )
    return CoordinatorApp(settings=settings, coordinator=coordinator, running=running, http=http)


def _drain_both(http: Any, coordinator: Coordinator):
    """The drain hook with the HTTP API: it stops taking new requests too, then sessions drain."""

    async def drain() -> None:
        http.begin_drain()
        await coordinator.drain()

    return drain


async def serve(settings: CoordinatorSettings) -> None:
    """Run a coordinator until SIGTERM / SIGINT, then shut it down gracefully."""
    await run_role(settings, lambda: start_coordinator(settings))
