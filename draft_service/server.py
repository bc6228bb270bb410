"""Building and running the draft service.

:func:`build_draft` wires a model, the KV-cache store, the committed-token
history, the proposers (model and n-gram), the engine and the servicer from one
:class:`~specserve.config.DraftSettings`; :func:`start_draft` also starts the
gRPC server (tests bind port 0 and read :attr:`DraftApp.port`); :func:`serve`
runs it until SIGTERM / SIGINT (the CLI's entry point): health NOT_SERVING,
wait for the model call in flight, stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from draft_service.engine import DraftEngine
from draft_service.history import CommittedHistory
from draft_service.proposers import ModelProposer, NgramProposer
from draft_service.servicer import DraftServicer
from specserve.config import DraftSettings
from specserve.kvcache import SessionCacheStore
from specserve.models import LoadedModel, load_model, resolve_model_path
from specserve.server import (
    Registration,
    RunningServer,
    create_server,
    run_role,
)
from specserve.v1 import draft_pb2, draft_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


@dataclass
class DraftApp:
    """Everything one draft replica holds; ``running`` once the server is started."""

    settings: DraftSettings
    model: LoadedModel
    caches: SessionCacheStore
    engine: DraftEngine
    servicer: DraftServicer
    running: RunningServer | None = None

    @property
    def port(self) -> int:
        if self.running is None:
            raise RuntimeError("the draft server is not started")
        return self.running.port

    async def drain(self) -> None:
        """Wait for the model call in flight (if any) to finish."""
        await self.servicer.idle()

    async def stop(self, grace: float | None = None) -> None:
        if self.running is not None:
            await self.running.stop(self.settings.shutdown_grace_s if grace is None else grace)
        self.servicer.close()


def build_draft(settings: DraftSettings, *, model: LoadedModel | None = None) -> DraftApp:
    """Wire a draft replica from ``settings`` (``model`` may be passed in, e.g. by tests)."""
    if model is None:
        model = load_model(
            resolve_model_path(settings.model, "draft"),
            device=settings.device,
            dtype=settings.dtype,
            warmup=settings.warmup,
        )
    caches = SessionCacheStore(
        model.model,
        max_sessions=settings.max_sessions,
        budget_bytes=settings.kv_budget_bytes,
        ttl_s=settings.session_ttl_s,
    )
    history = CommittedHistory(max_sessions=settings.max_sessions, ttl_s=settings.session_ttl_s)
    proposers = [ModelProposer(caches), NgramProposer()]
    engine = DraftEngine({p.kind: p for p in proposers}, history)
    servicer = DraftServicer(engine, model.info, max_gamma=settings.max_gamma, caches=caches)
    return DraftApp(settings=settings, model=model, caches=caches, engine=engine, servicer=servicer)


async def start_draft(settings: DraftSettings, *, model: LoadedModel | None = None) -> DraftApp:
    """Build a draft replica and start its gRPC server on ``settings.host:settings.port``."""
    app = build_draft(settings, model=model)
    app.running = await create_server(
        settings,
        [Registration(draft_pb2_grpc.add_DraftServiceServicer_to_server, app.servicer, SERVICE_NAME)],
        drain=app.drain,
    )
    log.info(
        "draft_started",
        port=app.running.port,
        model=app.model.name,
        vocab_size=app.model.vocab_size,
        max_gamma=settings.max_gamma,
    )
    return app


async def serve(settings: DraftSettings) -> None:
    """Run a draft replica until SIGTERM / SIGINT, then shut it down gracefully."""
    await run_role(settings, lambda: start_draft(settings))
