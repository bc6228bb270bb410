"""The draft service's app: its parts wired from settings, in the shared worker shell.

:func:`build_draft` wires the model, the KV-cache store, the committed-token
history, the proposers (model and n-gram), the :class:`DraftEngine` and the
servicer from one :class:`~specserve.runtime.config.DraftSettings`. The shell
(:class:`~specserve.runtime.worker_shell.WorkerApp`) serves it: :func:`start_draft` binds the
port (tests bind 0 and read :attr:`DraftApp.port`), :func:`serve` runs until
SIGTERM / SIGINT (the CLI's entry point).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.draft.engine import DraftEngine
from specserve.draft.feature_proposer import FeatureProposer
from specserve.draft.history import CommittedHistory
from specserve.draft.kernel_timing import drafting_kernels
from specserve.draft.proposers import ModelProposer, Proposer
from specserve.draft.servicer import DraftServicer
from specserve.engine.grammar import SessionGrammars
from specserve.engine.kvcache import SessionCacheStore
from specserve.engine.model_thread import ModelThread
from specserve.engine.models import LoadedModel
from specserve.runtime import metrics
from specserve.runtime.config import DraftSettings
from specserve.runtime.server import Registration, run_role
from specserve.runtime.worker_shell import WorkerApp, load_worker_head, load_worker_model, session_caches
from specserve.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


@dataclass(kw_only=True)
class DraftApp(WorkerApp):
    """One draft replica: the shell's parts plus its engine (the model thread's owner) and servicer."""

    role = "draft"
    engine: DraftEngine
    servicer: DraftServicer

    @property
    def work(self) -> DraftEngine:
        return self.engine

    def registration(self) -> Registration:
        return Registration(draft_pb2_grpc.add_DraftServiceServicer_to_server, self.servicer, SERVICE_NAME)


def build_draft(settings: DraftSettings, *, model: LoadedModel | None = None) -> DraftApp:
    """Wire a draft replica from ``settings`` (``model`` may be passed in, e.g. by tests)."""
    thread = ModelThread("draft-model")
    if model is None:  # loaded on the model thread, where it runs
        model = thread.call(load_worker_model, settings, "draft")
    caches = session_caches(model, settings, "draft")
    history = CommittedHistory(max_sessions=settings.max_sessions, ttl_s=settings.session_ttl_s)
    grammars = SessionGrammars(
        model.tokenizer, model.vocab_size, model.eos_token_ids, max_sessions=settings.max_sessions
    )
    kernels = thread.call(drafting_kernels, settings, model)
    proposer = ModelProposer(caches, kernels=kernels, grammars=grammars)
    proposers: dict[int, Proposer] = {proposer.kind: proposer}
    head = thread.call(load_worker_head, settings, model)
    if head is not None:
        head_caches = SessionCacheStore(
            head,
            max_sessions=settings.max_sessions,
            budget_bytes=caches.budget,  # one kv_budget_bytes for the draft model's and the head's caches
            ttl_s=settings.session_ttl_s,
            prefix_cache=settings.prefix_cache,
            block_tokens=settings.prefix_block_tokens,
            on_lookup=metrics.prefix_lookup_counter("head"),
        )
        feature = FeatureProposer(head, head_caches, kernels=kernels)
        proposers[feature.kind] = feature
    engine = DraftEngine(
        proposers,
        history,
        caches=caches,
        max_batch_size=settings.max_batch_size,
        eos_token_ids=model.eos_token_ids,
        thread=thread,
        grammars=grammars,
    )
    max_tokens = min(settings.max_session_tokens, model.max_positions or settings.max_session_tokens)
    servicer = DraftServicer(
        engine,
        model.info,
        max_gamma=settings.max_gamma,
        max_tokens=max_tokens,
        feature=head.feature_name if head is not None else "",
    )
    return DraftApp(settings=settings, model=model, caches=caches, engine=engine, servicer=servicer)


async def start_draft(settings: DraftSettings, *, model: LoadedModel | None = None) -> DraftApp:
    """Build a draft replica and serve it on ``settings.host:settings.port``."""
    return await build_draft(settings, model=model).start()


async def serve(settings: DraftSettings) -> None:
    """Run a draft replica until SIGTERM / SIGINT, then shut it down gracefully."""
    await run_role(settings, lambda: start_draft(settings))
