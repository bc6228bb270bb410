"""The target service's app: its parts wired from settings, in the shared worker shell.

:func:`build_target` wires the model, the session cache store, the Redis store
(its own, unless one is passed in), the :class:`Verifier` and the servicer from
one :class:`~specserve.runtime.config.TargetSettings`; with ``invariant`` on (the default) the model's
passes are made invariant (:func:`specserve.engine.position_invariant.prepare`) before anything runs on it.
The shell (:class:`~specserve.runtime.worker_shell.WorkerApp`) serves it: :func:`start_target` binds the
port, :func:`serve` runs until SIGTERM / SIGINT (the CLI's entry point); a
stop also closes the Redis store the app owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from specserve.engine import position_invariant
from specserve.engine.model_thread import ModelThread
from specserve.engine.models import LoadedModel
from specserve.runtime.config import TargetSettings
from specserve.runtime.server import Registration, run_role
from specserve.runtime.store import SessionStore
from specserve.runtime.worker_shell import WorkerApp, load_target_features, load_worker_model, session_caches
from specserve.target.calibration import CURVE_MAX_POSITIONS
from specserve.target.servicer import TargetServicer
from specserve.target.verifier import Verifier
from specserve.v1 import target_pb2, target_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


@dataclass(kw_only=True)
class TargetApp(WorkerApp):
    """One target replica: the shell's parts plus the Redis store, the verifier and the servicer."""

    role = "target"
    settings: TargetSettings
    store: SessionStore
    verifier: Verifier
    servicer: TargetServicer
    owns_store: bool = True

    @property
    def work(self) -> Verifier:
        return self.verifier

    def registration(self) -> Registration:
        return Registration(target_pb2_grpc.add_TargetServiceServicer_to_server, self.servicer, SERVICE_NAME)

    def facts(self) -> dict[str, Any]:
        return {
            **super().facts(),
            "max_batch_size": self.settings.max_batch_size,
            "feature": self.caches.feature_maker.name,
        }

    async def start(self) -> TargetApp:
        if self.settings.measure_verify_cost:
            await self.verifier.measure_cost(min(self.settings.max_gamma + 1, CURVE_MAX_POSITIONS))
        return await super().start()

    async def _close_resources(self) -> None:
        if self.owns_store:
            await self.store.close()


def build_target(
    settings: TargetSettings, *, model: LoadedModel | None = None, store: SessionStore | None = None
) -> TargetApp:
    """Wire a target replica from ``settings`` (``model`` / ``store`` may be passed in, e.g. by tests)."""
    thread = ModelThread("target-model")
    if model is None:  # loaded on the model thread, where it runs
        model = thread.call(lambda: load_worker_model(settings, "target", kernels=settings.kernels))
    if settings.invariant:
        loaded = model
        swapped = thread.call(lambda: position_invariant.prepare(loaded.model))
        kernels = position_invariant.kernels_of(model.model)
        log.info("target_passes_invariant", linear_layers=swapped, kernels=kernels)
    owns_store = store is None
    if store is None:
        store = SessionStore.from_url(settings.redis_url.get_secret_value())
    features = thread.call(load_target_features, settings, model)
    caches = session_caches(model, settings, "target", feature_maker=features)
    verifier = Verifier(model, caches, store, thread=thread, features_per_call_bytes=settings.feature_bytes_per_call)
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
    """Build a target replica and serve it on ``settings.host:settings.port``."""
    return await build_target(settings, model=model, store=store).start()


async def serve(settings: TargetSettings) -> None:
    """Run a target replica until SIGTERM / SIGINT, then shut it down gracefully."""
    await run_role(settings, lambda: start_target(settings))
