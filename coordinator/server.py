"""Building and running the coordinator.

:func:`start_coordinator` wires the Redis store, the worker pool (clients,
batchers, replica health), the cost model and policy, the tokenizer and the
servicer from one :class:`~specserve.config.CoordinatorSettings`, checks the
workers it can reach (a draft whose vocabulary differs from the target's is
refused), and starts the gRPC server; :func:`serve` runs it until SIGTERM /
SIGINT (the CLI's entry point): health NOT_SERVING, drain the sessions, stop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog

from coordinator.generation import Coordinator
from coordinator.policy import CostModel
from coordinator.pool import WorkerPool
from coordinator.servicer import CoordinatorServicer
from coordinator.workers import WorkerInfo
from specserve import errors
from specserve.config import CoordinatorSettings
from specserve.interceptors import BearerTokenInterceptor
from specserve.models import check_same_vocabulary, resolve_model_path
from specserve.server import (
    Registration,
    RunningServer,
    create_server,
    run_role,
)
from specserve.store import SessionStore
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name

#: How long start-up waits for each worker's info before going on without it.
INFO_TIMEOUT_S = 5.0


@dataclass
class CoordinatorApp:
    """A running coordinator: its domain service and its server."""

    settings: CoordinatorSettings
    coordinator: Coordinator
    running: RunningServer

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace: float | None = None) -> None:
        await self.running.stop(self.settings.shutdown_grace_s if grace is None else grace)
        await self.coordinator.close()


def load_tokenizer(settings: CoordinatorSettings) -> Any:
    """The target's tokenizer (settings.tokenizer, or the embedded demo target's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve_model_path(settings.tokenizer, "target"), local_files_only=True
    )


async def _infos(clients: dict[str, Any]) -> dict[str, WorkerInfo]:
    async def one(ep: str, client: Any) -> tuple[str, WorkerInfo | None]:
        try:
            return ep, await client.info(timeout_s=INFO_TIMEOUT_S)
        except errors.SpecServeError as exc:
            log.warning("worker_info_unavailable", endpoint=ep, error=exc.message)
            return ep, None

    pairs = await asyncio.gather(*(one(ep, c) for ep, c in clients.items()))
    return {ep: info for ep, info in pairs if info is not None}


async def build_coordinator(
    settings: CoordinatorSettings, *, tokenizer: Any = None, store: SessionStore | None = None
) -> Coordinator:
    """Wire a coordinator from ``settings``; checks the workers it can reach."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings)
    store = store or SessionStore.from_url(settings.redis_url.get_secret_value())
    pool = WorkerPool(settings, CostModel())
    try:
        return await _check_workers(settings, pool, store, tokenizer)
    except BaseException:
        await pool.close()
        raise


async def _check_workers(
    settings: CoordinatorSettings, pool: WorkerPool, store: SessionStore, tokenizer: Any
) -> Coordinator:
    targets = await _infos(pool.target_clients)
    drafts = await _infos(pool.draft_clients)
    max_gamma = settings.max_gamma
    vocab_size = len(tokenizer)
    if targets:
        first = next(iter(targets.values()))
        vocab_size = first.model.vocab_size
        max_gamma = min(max_gamma, *(i.max_gamma for i in targets.values()))
        for info in (*targets.values(), *drafts.values()):
            check_same_vocabulary(info.model, first.model)
        target_batch = min(i.max_batch_size or settings.max_batch_size for i in targets.values())
        for batcher in pool.batchers.values():
            batcher.max_batch_size = min(batcher.max_batch_size, target_batch)
    else:
        log.warning("no_target_reachable_at_start", endpoints=settings.target_endpoints)
    if drafts:
        max_gamma = min(max_gamma, *(i.max_gamma for i in drafts.values()))
    if len(tokenizer) > vocab_size:
        raise errors.VocabularyMismatch(
            f"the coordinator's tokenizer has {len(tokenizer)} tokens but the target's vocabulary only {vocab_size}; "
            "point `tokenizer` at the target model's directory"
        )
    return Coordinator(
        settings, store=store, pool=pool, tokenizer=tokenizer, vocab_size=vocab_size, max_gamma=max_gamma
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
        )
    except BaseException:
        await coordinator.close()
        raise
    log.info(
        "coordinator_started",
        port=running.port,
        targets=settings.target_endpoints,
        drafts=settings.draft_endpoints,
        max_gamma=coordinator.max_gamma,
        max_batch_size=settings.max_batch_size,
        max_batch_wait_ms=settings.max_batch_wait_ms,
    )
    return CoordinatorApp(settings=settings, coordinator=coordinator, running=running)


async def serve(settings: CoordinatorSettings) -> None:
    """Run a coordinator until SIGTERM / SIGINT, then shut it down gracefully."""
    await run_role(settings, lambda: start_coordinator(settings))
