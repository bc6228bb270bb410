"""The draft replica's domain object: Propose calls in, proposals out, many sessions per forward pass.

:class:`DraftEngine` holds the :class:`~specserve.draft.history.CommittedHistory`
(what this replica knows of each session's committed tokens), one
:class:`~specserve.draft.proposers.Proposer` per ``ProposerKind``, and the
replica's :class:`~specserve.engine.model_thread.ModelThread`.

A call (:meth:`DraftEngine.propose_batch`; :meth:`DraftEngine.propose` is a call
of one) is handled in two parts, after its constrained items' constraints that the
grammar engine does not hold are compiled on threads of their own
(:meth:`~specserve.engine.grammar.SessionGrammars.prepare`: the model thread drafts
other calls meanwhile; each item then carries its compiled grammar, ``DraftRequest.grammar``, so
the model thread never compiles):

1. **On the event loop, in arrival order**: each item's committed prefix ``C``
   is resolved against the history (the ``start_position`` protocol) and
   recorded. A bad item gets its own error; the others go on. An item for the
   n-gram proposer is refused with FAILED_PRECONDITION: the coordinator drafts
   n-grams itself, with no draft call.
2. **Model work** joins the replica's queue. The model thread takes everything
   queued, up to ``max_batch_size`` items at a time, and drafts it with one
   forward pass per draft step (:meth:`~specserve.draft.proposers.ModelProposer.propose_batch`):
   items of one call, of calls that arrived together, and of calls that
   queued while the previous batch ran all share passes. Nothing waits on
   purpose: a lone item is drafted as soon as the thread is free.

Every model call and every cache mutation runs on the model thread (the
KV-cache store is not thread-safe); the history is the event loop's. A failed
batch fails each of its items with the error (its caches are dropped). Exported:
``specserve_draft_queue_depth`` (items waiting or being drafted),
``specserve_draft_batch_occupancy`` (items of the last pass / ``max_batch_size``)
and ``specserve_draft_batch_size``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from specserve.api.errors import FailedPrecondition, NotFound, SpecServeError, Unavailable
from specserve.api.params import PROPOSER_KINDS
from specserve.draft.history import CommittedHistory
from specserve.draft.messages import ProposeCall, ProposeResult
from specserve.draft.proposers import Drafted, DraftRequest, Proposer
from specserve.engine.grammar import Prepared, SessionGrammars
from specserve.engine.kvcache import SessionCacheStore
from specserve.engine.model_thread import ModelThread
from specserve.runtime import metrics

log = structlog.get_logger(__name__)

#: One item's answer: its proposal, or why it has none.
ItemOutcome = ProposeResult | SpecServeError


@dataclass(eq=False)
class _Job:
    """One item waiting for the model thread."""

    request: DraftRequest
    proposer: Proposer
    future: asyncio.Future[Drafted]
    loop: asyncio.AbstractEventLoop


class DraftEngine:
    """Proposes tokens for many sessions; see the module docstring.

    ``caches``: the model proposer's cache store, reported in the cache gauges with the stores that share its
    budget (the feature head's; None: no gauges).
    ``max_batch_size``: most items drafted in one pass (1: every session alone).
    ``eos_token_ids``: the model's end-of-sequence tokens (drafting ends after one unless the call ignores EOS).
    ``grammars``: the model proposer's constrained sessions' matchers, whose constraints a call compiles
    before its items join the queue (None: nothing is compiled ahead).
    """

    def __init__(
        self,
        proposers: Mapping[int, Proposer],
        history: CommittedHistory,
        *,
        caches: SessionCacheStore | None = None,
        max_batch_size: int = 32,
        eos_token_ids: frozenset[int] = frozenset(),
        thread: ModelThread | None = None,
        grammars: SessionGrammars | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.proposers = dict(proposers)
        self.history = history
        self.caches = caches
        self.max_batch_size = max_batch_size
        self.eos_token_ids = eos_token_ids
        self.thread = thread or ModelThread("draft-model")
        self.grammars = grammars
        self._queue: collections.deque[_Job] = (
            collections.deque()
        )  # appended on the loop, taken on the thread
        self._drafting = 0  # items in the pass now running
        self._background: set[asyncio.Future] = set()
        #: Batches drafted (each one forward pass per draft step) and the items they held.
        self.batches = 0
        self.items_drafted = 0

    async def propose(self, call: ProposeCall) -> ProposeResult:
        """Draft for one call; its error is raised."""
        (outcome,) = await self.propose_batch([call])
        if isinstance(outcome, SpecServeError):
            raise outcome
        return outcome

    async def propose_batch(self, calls: Sequence[ProposeCall]) -> list[ItemOutcome]:
        """Draft for every call (distinct sessions), in order; an item's error is its outcome."""
        start = time.perf_counter_ns()
        grammars: Prepared = {}
        if self.grammars is not None:  # off the model thread: a slow compile holds up this call only
            model = PROPOSER_KINDS["model"]
            grammars = await self.grammars.prepare(
                c.sampling.constraint
                for c in calls
                if c.sampling.constraint and c.gamma and c.proposer == model
            )
        outcomes: list[ItemOutcome | None] = [None] * len(calls)
        waiting: list[tuple[int, asyncio.Future[Drafted]]] = []
        loop = asyncio.get_running_loop()
        for i, call in enumerate(calls):
            try:
                request, proposer = self._resolve(call, grammars)
                if call.gamma == 0:
                    outcomes[i] = self._result(call, Drafted(token_ids=(), probs_f32=None), start)
                else:
                    future: asyncio.Future[Drafted] = loop.create_future()
                    self._queue.append(_Job(request, proposer, future, loop))
                    waiting.append((i, future))
            except SpecServeError as exc:
                outcomes[i] = exc
        if waiting:
            self._set_depth()
            drain = asyncio.ensure_future(self.thread.run(self._drain))
            self._background.add(drain)
            drain.add_done_callback(self._drain_done)
            done = await asyncio.gather(*(f for _, f in waiting), return_exceptions=True)
            for (i, _), drafted in zip(waiting, done, strict=True):
                if isinstance(drafted, SpecServeError):
                    outcomes[i] = drafted
                elif isinstance(drafted, BaseException):
                    raise drafted
                else:
                    outcomes[i] = self._result(calls[i], drafted, start)
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    async def release(self, session_id: str) -> None:
        """Drop everything held for the session; :class:`NotFound` when nothing was."""
        known = session_id in self.history
        if known:
            self.history.release(session_id)
        held = await self.thread.run(self._release_caches, [session_id])
        if not (known or held):
            raise NotFound(
                f"session {session_id!r} is not known to this draft (never seen, released or expired)"
            )
        log.info("session_released", session_id=session_id, reason="request")

    async def idle(self) -> None:
        """Wait until every call submitted so far has finished."""
        await self.thread.idle()

    def close(self) -> None:
        """Stop the model thread; calls not started yet are cancelled (and the grammars' preparing threads)."""
        self.thread.close(wait=False)
        if self.grammars is not None:
            self.grammars.close()

    @property
    def queue_depth(self) -> int:
        """Items waiting for the model thread or being drafted."""
        return len(self._queue) + self._drafting

    # ---- on the event loop -----------------------------------------------------------------

    def _resolve(self, call: ProposeCall, grammars: Prepared) -> tuple[DraftRequest, Proposer]:
        proposer = self.proposers.get(call.proposer)
        if proposer is None and call.proposer == PROPOSER_KINDS["ngram"]:
            raise FailedPrecondition(
                "a draft server does not draft n-grams: the coordinator drafts the n-gram proposer itself, "
                "with no draft call; send PROPOSER_KIND_MODEL"
            )
        if proposer is None:
            name = _kind_name(call.proposer)
            raise FailedPrecondition(f"this draft server has no {name} proposer; use one of {self._kinds()}")
        committed = self.history.resolve(call.session_id, call.start_position, call.token_ids)
        dropped = self.history.record(call.session_id, committed)
        if dropped:
            self._in_background(self.thread.run(self._release_caches, dropped))
        request = DraftRequest(
            session_id=call.session_id,
            committed=committed,
            gamma=call.gamma,
            sampling=call.sampling,
            seed=call.seed,
            draft_top_k=call.draft_top_k,
            stop_token_ids=call.stop_token_ids | (frozenset() if call.ignore_eos else self.eos_token_ids),
            min_confidence=call.min_confidence,
            features=call.features,
            features_reset=call.features_reset,
            stop_tokens_from=call.stop_tokens_from,
            prompt_len=call.prompt_len,
            cache_scope=call.cache_scope,
            tree=call.tree,
            grammar=grammars.get(call.sampling.constraint) if call.sampling.constraint else None,
        )
        return request, proposer

    def _result(self, call: ProposeCall, drafted: Drafted, start_ns: int) -> ProposeResult:
        elapsed = time.perf_counter_ns() - start_ns
        log.debug(
            "proposed",
            session_id=call.session_id,
            committed_len=call.base.committed_len,
            gamma=call.gamma,
            proposed=len(drafted.token_ids),
            tree=bool(drafted.parents),
            prefill_tokens=drafted.prefill_tokens,
            draft_ns=elapsed,
        )
        return ProposeResult(drafted=drafted, draft_ns=elapsed)

    def _in_background(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("draft_background_failed", error=repr(task.exception()))

    def _drain_done(self, task: asyncio.Future) -> None:
        """A drain that could not run (the thread stopped) or broke fails the items still queued."""
        self._background.discard(task)
        if not task.cancelled() and task.exception() is None:
            return
        error = Unavailable("the draft's model thread stopped (shutting down?); propose again elsewhere")
        if not task.cancelled():
            log.error("draft_drain_failed", error=repr(task.exception()))
        while self._queue:
            job = self._queue.popleft()
            job.loop.call_soon(_resolve_future, job.future, error)
        self._set_depth()

    def _set_depth(self) -> None:
        metrics.DRAFT_QUEUE_DEPTH.set(self.queue_depth)

    # ---- on the model thread ---------------------------------------------------------------

    def _drain(self) -> None:
        """Draft everything queued, ``max_batch_size`` items per batch (each batch: one pass per step)."""
        self.thread.check()
        while self._queue:
            jobs: list[_Job] = []
            while self._queue and len(jobs) < self.max_batch_size:
                job = self._queue.popleft()
                if not job.future.cancelled():  # the caller went away while it waited
                    jobs.append(job)
            if not jobs:
                continue
            self._drafting = len(jobs)
            self._set_depth()
            try:
                settled = self._draft(jobs)
            finally:
                self._drafting = 0
                self._set_depth()
                self._update_gauges()
            for job, outcome in settled:  # after the bookkeeping: a caller that resumes sees the batch done
                job.loop.call_soon_threadsafe(_resolve_future, job.future, outcome)

    def _draft(self, jobs: list[_Job]) -> list[tuple[_Job, Drafted | BaseException]]:
        by_proposer: dict[int, list[_Job]] = {}
        for job in jobs:
            by_proposer.setdefault(id(job.proposer), []).append(job)
        self.batches += 1
        self.items_drafted += len(jobs)
        metrics.DRAFT_BATCH_SIZE.observe(len(jobs))
        metrics.DRAFT_BATCH_OCCUPANCY.set(len(jobs) / self.max_batch_size)
        settled: list[tuple[_Job, Drafted | BaseException]] = []
        for group in by_proposer.values():
            try:
                outcomes = group[0].proposer.propose_batch([job.request for job in group])
            except Exception as exc:  # a bug or an exhausted device: every item of the batch fails
                log.exception("draft_batch_failed", sessions=[job.request.session_id for job in group])
                outcomes = [exc] * len(group)
            settled += zip(group, outcomes, strict=True)
        return settled

    def _release_caches(self, session_ids: Sequence[str]) -> bool:
        self.thread.check()
        try:
            held = [p.release(sid) for sid in session_ids for p in self.proposers.values()]
            return any(held)
        finally:
            self._update_gauges()

    def _update_gauges(self) -> None:
        if self.caches is not None:  # with the stores that share its budget (the feature head's)
            budget = self.caches.budget
            metrics.CACHED_SESSIONS.labels(role="draft").set(sum(len(store) for store in budget.stores))
            metrics.KV_CACHE_BYTES.labels(role="draft").set(budget.total_bytes)

    def _kinds(self) -> list[str]:
        return [_kind_name(k) for k in self.proposers]


def _kind_name(kind: int) -> str:
    """A ``ProposerKind``'s name on the wire (``PROPOSER_KIND_MODEL``)."""
    name = next((n for n, k in PROPOSER_KINDS.items() if k == kind), None)
    return f"PROPOSER_KIND_{name.upper()}" if name else f"proposer kind {kind}"


def _resolve_future(future: asyncio.Future, outcome: Drafted | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
