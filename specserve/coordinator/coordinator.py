"""The coordinator's domain service: one :meth:`Coordinator.generate` per client request.

A request is admitted first (:meth:`Coordinator.admit`: its session place and rate token under
:mod:`specserve.coordinator.admission`), before any work on it; then :meth:`Coordinator.parse` checks it
(tokenizing, compiling its constraint), and ``generate`` runs it in its place: it creates
the session in Redis (the prompt at version 0, the seed recorded with the
sampling settings), takes the session's owner lease, runs the round loop
(:mod:`specserve.coordinator.round`) until a stop condition is committed, and yields a
:class:`Chunk` per round that committed tokens (ids + a text delta that never
splits a character) and a final :class:`Finished` carrying the statistics.
With ``logprobs`` requested, each chunk carries one
:class:`~specserve.api.params.PositionLogprobs` per token. When the caller stops
iterating (client cancellation) or anything fails, the
session's caches on every worker it used are released and its lease dropped,
in a tracked background task so that the caller's cancellation cannot cut the
clean-up short; its keys in Redis are then deleted (or kept ``keep_ended_sessions_s``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from specserve.api import errors
from specserve.api.params import PROPOSER_KINDS, GenerationParams, PositionLogprobs
from specserve.api.stats import FINISH_REASON_NAMES, PROPOSER_NAMES, GenerationStats, SourceStats
from specserve.coordinator import cache_scope
from specserve.coordinator.admission import Admission, Place, SessionRate
from specserve.coordinator.chat import ChatMessage, TemplateOptions, chat_prompt_ids
from specserve.coordinator.clients import ClientKeys
from specserve.coordinator.constraint_compiler import ConstraintCompiler
from specserve.coordinator.detokenize import IncrementalDetokenizer
from specserve.coordinator.fleet.limits import Limits
from specserve.coordinator.fleet.pool import WorkerPool
from specserve.coordinator.requests import GenerationRequest, Prompt
from specserve.coordinator.round import Committed, RoundLoop
from specserve.coordinator.session import Session, SessionStatus
from specserve.coordinator.speculation.acceptance import AcceptanceMemory
from specserve.coordinator.speculation.policy import FixedGamma, SpeculationPolicy
from specserve.coordinator.speculation.speculator import Speculator
from specserve.runtime import metrics
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.store import SessionStore

log = structlog.get_logger(__name__)

#: Threads that tokenize text prompts (each prompt is at most ``max_prompt_bytes``).
TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class Chunk:
    """Newly committed tokens and their text (and their logprobs, one per token, when asked for)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[PositionLogprobs, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The closing statistics (always the last event)."""

    stats: GenerationStats


def default_proposer(setting: str, feature_head: bool) -> int:
    """The ``ProposerKind`` of a request that names none: ``setting`` ('auto', 'model' or 'feature'), with
    'auto' the feature head where the draft tier serves one. Raises ``ValueError`` for 'feature' without it."""
    if setting == "feature" and not feature_head:
        raise ValueError(
            "default_proposer='feature' but the draft replicas serve no feature head; start them with "
            "--feature-head or set default_proposer to 'auto' or 'model'"
        )
    if setting == "feature" or (setting == "auto" and feature_head):
        return PROPOSER_KINDS["feature"]
    return PROPOSER_KINDS["model"]


def _grammar_engine(tokenizer: Any, vocab_size: int) -> Any:
    """The grammar engine over the target's tokenizer (built on a compiling thread, at the first constraint),
    with no cache of its own: the constraint compiler's is the process's one."""
    from specserve.engine.grammar import GrammarEngine  # the grammar engine loads only where constraints come

    eos = tokenizer.eos_token_id
    return GrammarEngine(tokenizer, vocab_size, [eos] if eos is not None else [], cache_size=0)


class Coordinator:
    """Sessions, the round loop and its workers, for one coordinator process.

    Built once (``specserve/coordinator/server.py``) from the probed :class:`~specserve.coordinator.fleet.limits.Limits`:
    ``pool`` and ``adaptive`` (the shared policy of requests without a fixed gamma) share one cost model.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        store: SessionStore,
        pool: WorkerPool,
        adaptive: SpeculationPolicy,
        tokenizer: Any,
        limits: Limits,
    ) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self.adaptive = adaptive
        self.tokenizer = tokenizer
        self.vocab_size = limits.vocab_size
        self.max_gamma = limits.max_gamma
        self.context_tokens = limits.context_tokens
        self.feature_head = limits.feature_head
        #: The proposer of a request that names none (CoordinatorSettings.default_proposer, resolved).
        self.default_proposer = default_proposer(settings.default_proposer, limits.feature_head)
        #: Acceptance pooled per kind of speculation across sessions: a new session's starting point.
        self.acceptance_memory = AcceptanceMemory()
        #: Tokenizing runs here, off the event loop (a long prompt must not stall other sessions).
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize"
        )
        self.owner = f"coordinator-{uuid.uuid4().hex[:12]}"
        self.admission = Admission(
            max_sessions=settings.max_sessions,
            max_sessions_per_client=settings.max_sessions_per_client,
            rate=SessionRate(rate=settings.session_rate_per_client, burst=settings.session_burst_per_client),
        )
        #: How callers are named for the per-client limits (specserve/coordinator/clients.py).
        self.clients = ClientKeys.from_settings(settings)
        self._cleanups: set[asyncio.Task] = set()
        #: Compiles each request's constraint before its session opens (specserve/coordinator/constraint_compiler.py).
        self.constraints = ConstraintCompiler(
            functools.partial(_grammar_engine, tokenizer, self.vocab_size),
            timeout_s=settings.constraint_compile_timeout_s,
            threads=settings.constraint_compile_threads,
            cache_size=settings.constraint_cache_size,
            queue=settings.constraint_compile_queue,
            per_client=settings.constraint_compile_queue_per_client,
        )

    async def parse(
        self, params: GenerationParams, prompt: Prompt, *, client: str | None = None
    ) -> GenerationRequest:
        """Check a front end's request against this server's limits (InvalidArgument says what to fix), cheapest
        checks first; a text prompt is tokenized off the event loop once its size is known to fit. A
        constraint is compiled in ``client``'s share of the compile queue (specserve/coordinator/constraint_compiler.py),
        and the request holds its compiled grammar. Only for an admitted request (:meth:`admit`): this is
        the request's work."""
        request = await GenerationRequest.check(
            params,
            prompt,
            settings=self.settings,
            tokenize=self.tokenize,
            render_chat=self.render_chat,
            vocab_size=self.vocab_size,
            max_gamma=self.max_gamma,
            context_tokens=self.context_tokens,
            default_proposer=self.default_proposer,
            feature_head=self.feature_head,
        )
        if request.sampling.constraint is not None:
            grammar = await self.constraints.compile(request.sampling.constraint, client)
            request = dataclasses.replace(request, grammar=grammar)
        return request

    async def tokenize(self, text: str) -> tuple[int, ...]:
        """The prompt's token ids, computed on the tokenizer threads."""
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._tokenizer_pool, functools.partial(self.tokenizer.encode, text, add_special_tokens=False)
        )
        return tuple(ids)

    async def render_chat(self, messages: list[ChatMessage], options: TemplateOptions) -> tuple[int, ...]:
        """A conversation's prompt ids (the chat template), computed on the tokenizer threads."""
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._tokenizer_pool, functools.partial(chat_prompt_ids, self.tokenizer, messages, options)
        )
        return tuple(ids)

    def _policy(self, request: GenerationRequest) -> SpeculationPolicy:
        gamma = request.speculation.gamma
        return self.adaptive if gamma is None else FixedGamma(gamma)

    def admit(self, client: str | None, sessions: int = 1) -> list[Place]:
        """``sessions`` places for ``client``'s request (the HTTP API's ``n``), taken before any work on it;
        ResourceExhausted with a retry hint when they do not fit the limits (nothing is then held).
        ``client``: a :class:`~specserve.coordinator.clients.ClientKeys` name (None: limited by ``max_sessions`` only).
        The caller releases a place its request does not run a session in."""
        return self.admission.admit(client, sessions)

    async def generate(
        self, request: GenerationRequest, place: Place, *, tenant: str = cache_scope.ANONYMOUS
    ) -> AsyncIterator[Chunk | Finished]:
        """Run one session to its end in ``place`` (from :meth:`admit`, released at the end), yielding
        chunks then the statistics. ``tenant`` (:func:`specserve.coordinator.cache_scope.tenant`) owns the prefix
        cache it may share."""
        with place:
            constraint = request.sampling.constraint
            if constraint is not None and request.grammar is None:  # not through parse(): compiled off the loop
                request = dataclasses.replace(request, grammar=await self.constraints.compile(constraint, place.client))
            session, loop = self._new_session(request, tenant)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                stop_strings=request.stop.stop_strings,
                skip_special_tokens=not request.keep_special_tokens,
            )
            lease = _Lease(self.store, session.session_id, self.owner, self.settings.lease_ttl_s)
            status = "error"
            try:
                await self._open(session, request, lease)
                last_emit: float | None = None
                while not session.finished:
                    new = await loop.step()
                    if new.token_ids:
                        last_emit = _observe_inter_token(last_emit, len(new.token_ids))
                    chunk = _chunk(new, session.finished, detok)
                    if chunk is not None:
                        yield chunk
                    await lease.keep()
                finished = self._finish(session)
                status = "ok"
                yield finished
            except (asyncio.CancelledError, GeneratorExit):
                status = "cancelled"
                _cancelled(session)
                raise
            except Exception:
                session.end(SessionStatus.FAILED)
                raise
            finally:
                loop.detach()
                metrics.REQUESTS.labels(status=status).inc()
                self._clean_up_later(loop, session.session_id)

    def _new_session(self, request: GenerationRequest, tenant: str) -> tuple[Session, RoundLoop]:
        """A session of ``tenant`` for ``request`` and its round loop (which counts it in the pool's load)."""
        r = request
        session = Session(
            uuid.uuid4().hex,
            r.prompt_token_ids,
            r.sampling,
            r.stop,
            r.speculation,
            top_logprobs=r.top_logprobs,
            cache_scope=cache_scope.cache_scope(tenant, r.cache_salt, mode=self.settings.prefix_cache_scope),
        )
        speculator = Speculator.build(
            session,
            request,
            fleet=self.pool,
            settings=self.settings,
            policy=self._policy(request),
            max_gamma=self.max_gamma,
            memory=self.acceptance_memory,
            matcher=self._matcher(r),
            encode=functools.partial(self.tokenizer.encode, add_special_tokens=False),
        )
        return session, RoundLoop(session, speculator, pool=self.pool, store=self.store)

    def _matcher(self, request: GenerationRequest) -> Any:
        """Builds a constrained request's grammar matcher (None: no constraint) from the grammar the request
        holds (compiled off the event loop; nothing compiles here)."""
        constraint = request.sampling.constraint
        if constraint is None:
            return None
        if request.grammar is None:
            raise errors.FailedPrecondition("the request's constraint was not compiled before its session opened")
        return functools.partial(self.constraints.engine().matcher, constraint, request.grammar)

    async def _open(self, session: Session, request: GenerationRequest, lease: _Lease) -> None:
        """Create the session in Redis and take its lease."""
        await self.store.create(session.session_id, request.prompt_token_ids, request.sampling, request.stop)
        await lease.take()
        metrics.PROMPT_TOKENS.inc(session.prompt_len)
        log.info(
            "session_started",
            session_id=session.session_id,
            prompt_tokens=session.prompt_len,
            gamma=request.speculation.gamma,
            proposer=request.speculation.proposer,
            seed=request.sampling.seed,
            temperature=request.sampling.temperature,
            prediction_tokens=len(request.prediction_token_ids or ()),
        )

    def _finish(self, session: Session) -> Finished:
        """The session committed its stop: its closing statistics."""
        session.end(SessionStatus.FINISHED)
        stats = generation_stats(session)
        metrics.TIME_TO_FIRST_TOKEN.observe(stats.first_token_ns / 1e9)
        if "prediction" in session.stats.sources:
            metrics.PREDICTION_TOKENS.labels(outcome="accepted").inc(stats.accepted_prediction_tokens)
            metrics.PREDICTION_TOKENS.labels(outcome="rejected").inc(stats.rejected_prediction_tokens)
        log.info(
            "session_finished",
            session_id=session.session_id,
            completion_tokens=stats.completion_tokens,
            rounds=stats.rounds,
            proposed=stats.proposed_tokens,
            accepted=stats.accepted_tokens,
            finish_reason=stats.finish_reason,
            accepted_prediction=stats.accepted_prediction_tokens,
            rejected_prediction=stats.rejected_prediction_tokens,
        )
        return Finished(stats)

    def _clean_up_later(self, loop: RoundLoop, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._clean_up(loop, session_id))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _clean_up(self, loop: RoundLoop, session_id: str) -> None:
        """Release the session's caches on its workers, then its keys in Redis (its log and lease):
        deleted, or kept ``keep_ended_sessions_s`` for inspection. While the session ran, replays and
        failover needed them; once it has ended nothing does."""
        try:
            await loop.release(wait_s=self.settings.rpc_timeout_s)
        except Exception:
            log.exception("release_failed", session_id=session_id)
        with contextlib.suppress(errors.SpecServeError):
            await self.store.end(session_id, self.owner, keep_s=self.settings.keep_ended_sessions_s)

    @property
    def active_sessions(self) -> int:
        return self.admission.active

    async def drain(self) -> None:
        """Wait for the sessions in progress to end, then for their clean-up (health is NOT_SERVING)."""
        await self.admission.idle()
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        await self.pool.close()
        await self.store.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.constraints.close()


def generation_stats(session: Session) -> GenerationStats:
    """The session's closing statistics (``lookup_*`` and ``forced_*``: the ``ngram`` and ``forced``
    sources' rows, for clients that predate ``sources``)."""
    s = session.stats
    lookup, forced = s.source("ngram"), s.source("forced")
    return GenerationStats(
        session_id=session.session_id,
        prompt_tokens=session.prompt_len,
        completion_tokens=session.committed_len - session.prompt_len,
        rounds=s.rounds,
        proposed_tokens=s.proposed_tokens,
        accepted_tokens=s.accepted_tokens,
        accepted_per_position=tuple(s.accepted_per_position),
        draft_ns=s.draft_ns,
        verify_ns=s.verify_ns,
        queue_ns=s.queue_ns,
        target_ns=s.target_ns,
        forward_ns=s.forward_ns,
        lookup_proposed_tokens=lookup.proposed_tokens,
        lookup_accepted_tokens=lookup.accepted_tokens,
        cached_tokens=s.cached_tokens,
        forced_proposed_tokens=forced.proposed_tokens,
        forced_accepted_tokens=forced.accepted_tokens,
        proposer=PROPOSER_NAMES.get(session.speculation.proposer, ""),
        first_token_ns=s.first_token_ns,
        total_ns=time.perf_counter_ns() - session.start_ns,
        finish_reason=FINISH_REASON_NAMES.get(session.finish_reason, str(session.finish_reason)),
        seed=session.sampling.seed,
        draft_rounds=s.draft_rounds,
        accepted_prediction_tokens=s.accepted_prediction_tokens,
        rejected_prediction_tokens=s.rejected_prediction_tokens,
        sources=tuple(
            SourceStats(
                name=name,
                draft_rounds=row.draft_rounds,
                proposed_tokens=row.proposed_tokens,
                accepted_tokens=row.accepted_tokens,
            )
            for name, row in s.sources.items()
        ),
    )


class _Lease:
    """A session's owner lease in Redis: taken at the start, renewed every third of its TTL."""

    def __init__(self, store: SessionStore, session_id: str, owner: str, ttl_s: float) -> None:
        self.store, self.session_id, self.owner, self.ttl_s = store, session_id, owner, ttl_s
        self._taken = 0.0

    async def take(self) -> None:
        await self.store.acquire_lease(self.session_id, self.owner, self.ttl_s)
        self._taken = time.monotonic()

    async def keep(self) -> None:
        """Renew the lease when a third of its TTL has passed since it was last taken."""
        if time.monotonic() - self._taken > self.ttl_s / 3:
            await self.take()


def _cancelled(session: Session) -> None:
    session.end(SessionStatus.CANCELLED)
    log.info(
        "session_cancelled",
        session_id=session.session_id,
        committed=session.committed_len - session.prompt_len,
    )


def _chunk(new: Committed, finished: bool, detok: IncrementalDetokenizer) -> Chunk | None:
    """The chunk for a round's new tokens (the detokenizer's tail once finished); None: nothing to send."""
    if new.token_ids:
        text = detok.push(new.token_ids)
        if finished:
            text += detok.finish()
        return Chunk(new.token_ids, text, new.logprobs)
    if finished:
        tail = detok.finish()
        if tail:
            return Chunk((), tail)
    return None


def _observe_inter_token(last_emit: float | None, n: int) -> float:
    """Observe the time since the last emitted tokens spread over the ``n`` new ones; returns now.

    The first tokens of a session are time to first token, not an inter-token gap.
    """
    now = time.monotonic()
    if last_emit is not None:
        gap = (now - last_emit) / n
        for _ in range(n):
            metrics.INTER_TOKEN_LATENCY.observe(gap)
    return now
