"""Building and running the target service.

:func:`build_target` wires a model, the session cache store, the Redis store,
the :class:`~target_service.verifier.Verifier` and the servicer from one
:class:`~specserve.config.TargetSettings`; :func:`start_target` also starts the
gRPC server (tests bind port 0 and read :attr:`TargetApp.port`); :func:`serve`
runs it until SIGTERM / SIGINT (the CLI's entry point): health NOT_SERVING,
wait for the batch in flight, stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from specserve.config import TargetSettings
from specserve.kvcache import SessionCacheStore
from specserve.models import LoadedModel, load_model, resolve_model_path
from specserve.server import (
    Registration,
    RunningServer,
    create_server,
    run_role,
)
from specserve.store import SessionStore
from specserve.v1 import target_pb2, target_pb2_grpc
from target_service.servicer import TargetServicer
from target_service.verifier import Verifier

log = structlog.get_logger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


@dataclass
class TargetApp:
    """Everything one target replica holds; ``running`` once the server is started."""

    settings: TargetSettings
    model: LoadedModel
    store: SessionStore
    caches: SessionCacheStore
    verifier: Verifier
    servicer: TargetServicer
    owns_store: bool = True
    running: RunningServer | None = None

    @property
    def port(self) -> int:
        if self.running is None:
            raise RuntimeError("the target server is not started")
        return self.running.port

    async def drain(self) -> None:
        """Wait for the Verify batch in flight (if any) to finish."""
        await self.verifier.idle()

    async def stop(self, grace: float | None = None) -> None:
        if self.running is not None:
            await self.running.stop(self.settings.shutdown_grace_s if grace is None else grace)
        self.verifier.close()
        if self.owns_store:
            await self.store.close()


def build_target(
    settings: TargetSettings, *, model: LoadedModel | None = None, store: SessionStore | None = None
) -> TargetApp:
    """Wire a target replica from ``settings`` (``model`` / ``store`` may be passed in, e.g. by tests)."""
    if model is None:
        model = load_model(
            resolve_model_path(settings.model, "target"),
            device=settings.device,
            dtype=settings.dtype,
            warmup=settings.warmup,
        )
    owns_store = store is None
    if store is None:
        store = SessionStore.from_url(settings.redis_url.get_secret_value())
    caches = SessionCacheStore(
        model.model,
        max_sessions=settings.max_sessions,
        budget_bytes=settings.kv_budget_bytes,
        ttl_s=settings.session_ttl_s,
    )
    verifier = Verifier(model, caches, store)
    servicer = TargetServicer(
        verifier, model, max_gamma=settings.max_gamma, max_batch_size=settings.max_batch_size
    )
    return TargetApp(
        settings=settings,
        model=model,
        store=store,
        caches=caches,
        verifier=verifier,
        servicer=servicer,
        owns_store=owns_store,
    )


async def start_target(
    settings: TargetSettings, *, model: LoadedModel | None = None, store: SessionStore | None = None
) -> TargetApp:
    """Build a target replica and start its gRPC server on ``settings.host:settings.port``."""
    app = build_target(settings, model=model, store=store)
    app.running = await create_server(
        settings,
        [Registration(target_pb2_grpc.add_TargetServiceServicer_to_server, app.servicer, SERVICE_NAME)],
        drain=app.drain,
    )
    log.info(
        "target_started",
        port=app.running.port,
        model=app.model.name,
        vocab_size=app.model.vocab_size,
        max_gamma=settings.max_gamma,
        max_batch_size=settings.max_batch_size,
    )
    return app


async def serve(settings: TargetSettings) -> None:
    """Run a target replica until SIGTERM / SIGINT, then shut it down gracefully."""
    await run_role(settings, lambda: start_target(settings))
