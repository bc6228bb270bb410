"""The app shell both worker roles (draft, target) build on.

A worker replica is a model, its session caches, a domain object that owns the
replica's :class:`~specserve.engine.model_thread.ModelThread` (the draft's
``DraftEngine``, the target's ``Verifier``) and a thin servicer.
:class:`WorkerApp` holds what every worker holds and does what every worker
does: :meth:`WorkerApp.start` serves it (:func:`specserve.runtime.server.create_server`:
health, reflection, the error interceptor, and the caller checks of
:func:`caller_checks`: the worker token, the pinned client certificates;
:class:`~specserve.runtime.config.WorkerSettings` refuses a worker that would listen
beyond loopback without either), :meth:`WorkerApp.drain` waits for
the model work in flight, :meth:`WorkerApp.stop` stops the server, then the
model thread. A role's ``server.py`` only wires its own parts (``build_*``)
and names its service.

:func:`load_worker_model` and :func:`session_caches` build the two parts every
worker has from its :class:`~specserve.runtime.config.WorkerSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import structlog

from specserve.api.errors import FailedPrecondition
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.feature_head import FeatureHead
from specserve.engine.feature_maker import FeatureMaker
from specserve.engine.kvcache import SessionCacheStore
from specserve.engine.models import LoadedModel, load_model, resolve_model_path
from specserve.runtime import metrics
from specserve.runtime.config import DraftSettings, TargetSettings, WorkerSettings
from specserve.runtime.interceptors import BearerTokenInterceptor, ClientCertificateInterceptor
from specserve.runtime.server import Registration, RunningServer, create_server

log = structlog.get_logger(__name__)

App = TypeVar("App", bound="WorkerApp")


class ModelWork(Protocol):
    """The domain object of a worker: the owner of its model thread."""

    async def idle(self) -> None:
        """Return once the model work submitted so far has finished."""

    def close(self) -> None:
        """Stop the model thread."""


def load_worker_model(
    settings: WorkerSettings, role: Literal["draft", "target"], *, kernels: Kernels = "stock"
) -> LoadedModel:
    """The role's model from ``settings.model`` (None: the default pair's), with ``kernels``
    (:mod:`specserve.engine.cpu_kernels`). Call it on the role's model thread: ``settings.threads`` (when set)
    becomes that thread's torch thread count before the model loads and times its kernels."""
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
    return load_model(
        resolve_model_path(settings.model, role),
        device=settings.device,
        dtype=settings.dtype,
        kernels=kernels,
        warmup=settings.warmup,
        # Replicas of one kind of machine run one kernel path, recorded in the deployment's Redis.
        kernel_store=settings.redis_url.get_secret_value() if kernels == "auto" else None,
    )


def _vocab_size(model_dir: Path) -> int | None:
    import json

    return json.loads((model_dir / "config.json").read_text()).get("vocab_size")


def load_worker_head(settings: DraftSettings, model: LoadedModel) -> FeatureHead | None:
    """The draft's feature head as ``settings`` name it (None: none), in ``model``'s device and dtype.

    Unset, the default draft serves the default pair's head when it is present and fits its vocabulary;
    'none' serves without one.
    A head that does not fit the draft's vocabulary is refused (:class:`FailedPrecondition`)."""
    from specserve.engine import model_registry
    from specserve.engine.feature_head import load_feature_head

    spec = settings.feature_head
    if spec is not None and spec.lower() == "none":
        return None
    if spec is None:
        named = settings.model and (model_registry.is_registered_cache(settings.model) or settings.model)
        if named not in (None, "", model_registry.DEFAULT_DRAFT):  # `specserve up` passes the draft's directory
            return None
        source = model_registry.REGISTRY.get(model_registry.DEFAULT_HEAD)
        if source is None or not source.present():
            return None
        spec = model_registry.DEFAULT_HEAD
    head_dir = Path(model_registry.resolve_model(spec, progress=False))
    if settings.feature_head is None and _vocab_size(head_dir) != model.vocab_size:
        return None  # the default pair's head serves only beside a draft of its vocabulary
    head = load_feature_head(head_dir, target=settings.feature_head_target, device=model.device, dtype=model.model.dtype)
    if head.config.vocab_size != model.vocab_size:
        raise FailedPrecondition(
            f"the feature head covers {head.config.vocab_size} tokens, the draft's vocabulary {model.vocab_size}"
        )
    return head


def load_target_features(settings: TargetSettings, model: LoadedModel) -> FeatureMaker:
    """What makes the target's features: the feature of the head ``settings.feature_head`` names (unset: the
    default pair's, beside the default target of its vocabulary, when present), else the last layer's.
    A head that does not fit the target is refused (:class:`FailedPrecondition`)."""
    from specserve.engine import model_registry

    spec = settings.feature_head
    if spec is not None and spec.lower() == "none":
        return FeatureMaker(model.model)
    if spec is None:
        named = settings.model and (model_registry.is_registered_cache(settings.model) or settings.model)
        source = model_registry.REGISTRY.get(model_registry.DEFAULT_HEAD)
        if named not in (None, "", model_registry.DEFAULT_TARGET) or source is None or not source.present():
            return FeatureMaker(model.model)
        spec = model_registry.DEFAULT_HEAD
    head_dir = Path(model_registry.resolve_model(spec, progress=False))
    if settings.feature_head is None and _vocab_size(head_dir) != model.vocab_size:
        return FeatureMaker(model.model)  # the default pair's head, only beside a target of its vocabulary
    return FeatureMaker.for_head(model.model, head_dir)


def caller_checks(settings: WorkerSettings) -> list[Any]:
    """The interceptors that authenticate a worker's callers: the shared worker token and / or the
    pinned client-certificate names (health and reflection stay open for probes)."""
    checks: list[Any] = []
    if settings.worker_token is not None:
        checks.append(BearerTokenInterceptor([settings.worker_token.get_secret_value()]))
    if settings.tls_client_names:
        checks.append(ClientCertificateInterceptor(settings.tls_client_names))
    return checks


def session_caches(
    model: LoadedModel, settings: WorkerSettings, role: str, *, feature_maker: FeatureMaker | None = None
) -> SessionCacheStore:
    """The replica's KV-cache store, limited as ``settings`` says, its prefix cache counted in the
    ``role``'s ``prefix_cache_*`` metrics; ``feature_maker``: a target's (:func:`load_target_features`)."""
    return SessionCacheStore(
        model.model,
        max_sessions=settings.max_sessions,
        budget_bytes=settings.kv_budget_bytes,
        ttl_s=settings.session_ttl_s,
        prefix_cache=settings.prefix_cache,
        block_tokens=settings.prefix_block_tokens,
        on_lookup=metrics.prefix_lookup_counter(role),
        feature_maker=feature_maker,
    )


@dataclass(kw_only=True)
class WorkerApp:
    """Everything one worker replica holds; ``running`` once the server is started."""

    #: The role's name, in logs ("draft", "target").
    role: ClassVar[str]

    settings: WorkerSettings
    model: LoadedModel
    caches: SessionCacheStore
    running: RunningServer | None = None

    # ---- what a role provides ------------------------------------------------------------
    @property
    def work(self) -> ModelWork:
        """The domain object that owns the model thread."""
        raise NotImplementedError

    def registration(self) -> Registration:
        """The role's servicer and service name."""
        raise NotImplementedError

    def facts(self) -> dict[str, Any]:
        """What the start-up log line says besides port, model and vocabulary."""
        return {"max_gamma": self.settings.max_gamma}

    async def _close_resources(self) -> None:
        """Release what the role owns besides the model thread (after the server stopped)."""

    # ---- the shell -----------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self.running is None:
            raise RuntimeError(f"the {self.role} server is not started")
        return self.running.port

    async def start(self: App) -> App:
        """Serve on ``settings.host:settings.port`` (port 0: a free one, see :attr:`port`)."""
        self.running = await create_server(
            self.settings, [self.registration()], interceptors=caller_checks(self.settings), drain=self.drain
        )
        log.info(
            f"{self.role}_started",
            port=self.running.port,
            model=self.model.name,
            vocab_size=self.model.vocab_size,
            callers="authenticated" if self.settings.authenticates_callers else "anyone who reaches the port",
            **self.facts(),
        )
        return self

    async def drain(self) -> None:
        """Wait for the model work in flight (if any) to finish."""
        await self.work.idle()

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (NOT_SERVING, drain, stop within ``grace``), then the model thread."""
        if self.running is not None:
            await self.running.stop(self.settings.shutdown_grace_s if grace is None else grace)
        self.work.close()
        await self._close_resources()
