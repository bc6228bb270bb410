"""The coordinator's domain service: one :meth:`Coordinator.generate` per client request.

``generate`` creates the session in Redis (the prompt at version 0, the seed
recorded with the sampling settings), takes the session's owner lease, runs the
round loop until a stop condition is committed, and yields a :class:`Chunk` per
round that committed tokens (ids + a text delta that never splits a character)
and a final :class:`Finished` carrying the statistics. When the caller stops
iterating (client cancellation) or anything fails, the session's caches on
every worker it used are released and its lease dropped, in a tracked
background task so that the caller's cancellation cannot cut the clean-up short.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from coordinator.detokenize import IncrementalDetokenizer
from coordinator.policy import AdaptiveGamma, CostModel, FixedGamma, SpeculationPolicy
from coordinator.pool import WorkerPool
from coordinator.requests import GenerationRequest
from coordinator.rounds import RoundLoop
from coordinator.session import Session, SessionStatus
from specserve import errors, metrics
from specserve.config import CoordinatorSettings
from specserve.store import SessionStore
from specserve.v1 import coordinator_pb2

log = structlog.get_logger(__name__)

#: How long a session's owner lease lasts; renewed every third of it while rounds run.
LEASE_TTL_S = 30.0
#: The retry hint sent with RESOURCE_EXHAUSTED when a session limit is reached.
SESSION_LIMIT_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class Chunk:
    """Newly committed tokens and their text."""

    token_ids: tuple[int, ...]
    text: str

    def to_pb(self) -> coordinator_pb2.GenerateResponse:
        return coordinator_pb2.GenerateResponse(
            chunk=coordinator_pb2.TokenChunk(token_ids=self.token_ids, text=self.text)
        )


@dataclass(frozen=True)
class Finished:
    """The closing statistics (always the last event)."""

    stats: coordinator_pb2.GenerationStats

    def to_pb(self) -> coordinator_pb2.GenerateResponse:
        return coordinator_pb2.GenerateResponse(stats=self.stats)


class Coordinator:
    """Sessions, the round loop and its workers, for one coordinator process."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        store: SessionStore,
        pool: WorkerPool,
        tokenizer: Any,
        vocab_size: int,
        max_gamma: int,
    ) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_gamma = max_gamma
        self.owner = f"coordinator-{uuid.uuid4().hex[:12]}"
        self.cost_model: CostModel = pool.cost_model
        self.adaptive: SpeculationPolicy = AdaptiveGamma(
            self.cost_model,
            choices=tuple(g for g in (0, 1, 2, 3, 4, 6, 8) if g <= max_gamma) or (0,),
            max_batch_size=settings.max_batch_size,
        )
        self._cleanups: set[asyncio.Task] = set()
        self._active = 0
        self._per_client: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def parse(self, pb: coordinator_pb2.GenerateRequest) -> GenerationRequest:
        """Check a wire request against this server's limits (InvalidArgument says what to fix)."""
        return GenerationRequest.from_pb(
            pb,
            settings=self.settings,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_gamma=self.max_gamma,
        )

    def _policy(self, request: GenerationRequest) -> SpeculationPolicy:
        gamma = request.speculation.gamma
        return self.adaptive if gamma is None else FixedGamma(gamma)

    def _admit(self, client: str | None) -> None:
        """Refuse a session over the total or the per-client limit (RESOURCE_EXHAUSTED with a retry hint)."""
        if self._active >= self.settings.max_sessions:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            raise errors.ResourceExhausted(
                f"the coordinator is running its maximum of {self.settings.max_sessions} sessions; retry shortly",
                retry_after_s=SESSION_LIMIT_RETRY_AFTER_S,
            )
        limit = self.settings.max_sessions_per_client
        if client is not None and self._per_client.get(client, 0) >= limit:
            metrics.REQUESTS.labels(status="resource_exhausted").inc()
            raise errors.ResourceExhausted(
                f"this client already runs its maximum of {limit} concurrent sessions; "
                "wait for one to finish and retry",
                retry_after_s=SESSION_LIMIT_RETRY_AFTER_S,
            )

    async def generate(
        self, request: GenerationRequest, *, client: str | None = None
    ) -> AsyncIterator[Chunk | Finished]:
        """Run one session to its end, yielding chunks then the statistics.

        ``client`` identifies the caller for ``max_sessions_per_client`` (None: not limited per client).
        """
        self._admit(client)
        session = Session(
            uuid.uuid4().hex,
            request.prompt_token_ids,
            request.sampling,
            request.stop,
            request.speculation,
        )
        sid = session.session_id
        self._active += 1
        if client is not None:
            self._per_client[client] = self._per_client.get(client, 0) + 1
        self._idle.clear()
        self.pool.active_sessions += 1
        metrics.ACTIVE_SESSIONS.inc()
        loop = RoundLoop(
            session, pool=self.pool, store=self.store, policy=self._policy(request), max_gamma=self.max_gamma
        )
        detok = IncrementalDetokenizer(self.tokenizer, stop_strings=request.stop.stop_strings)
        bound = log.bind(session_id=sid)
        status = "error"
        try:
            await self.store.create(sid, request.prompt_token_ids, request.sampling, request.stop)
            await self.store.acquire_lease(sid, self.owner, LEASE_TTL_S)
            lease_renewed = time.monotonic()
            last_emit: float | None = None
            bound.info(
                "session_started",
                prompt_tokens=session.prompt_len,
                gamma=request.speculation.gamma,
                proposer=request.speculation.proposer,
                seed=request.sampling.seed,
                temperature=request.sampling.temperature,
            )
            while not session.finished:
                new = await loop.step()
                if new:
                    last_emit = _observe_inter_token(last_emit, len(new))
                    text = detok.push(new)
                    if session.finished:
                        text += detok.finish()
                    yield Chunk(new, text)
                elif session.finished:
                    tail = detok.finish()
                    if tail:
                        yield Chunk((), tail)
                if time.monotonic() - lease_renewed > LEASE_TTL_S / 3:
                    await self.store.acquire_lease(sid, self.owner, LEASE_TTL_S)
                    lease_renewed = time.monotonic()
            session.end(SessionStatus.FINISHED)
            status = "ok"
            stats = session.stats_pb()
            metrics.TIME_TO_FIRST_TOKEN.observe(stats.first_token_ns / 1e9)
            bound.info(
                "session_finished",
                completion_tokens=stats.completion_tokens,
                rounds=stats.rounds,
                proposed=stats.proposed_tokens,
                accepted=stats.accepted_tokens,
                finish_reason=stats.finish_reason,
            )
            yield Finished(stats)
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            session.end(SessionStatus.CANCELLED)
            bound.info("session_cancelled", committed=session.committed_len - session.prompt_len)
            raise
        except Exception:
            session.end(SessionStatus.FAILED)
            raise
        finally:
            loop.detach()
            self._active -= 1
            if client is not None:
                self._per_client[client] -= 1
                if not self._per_client[client]:
                    del self._per_client[client]
            if self._active == 0:
                self._idle.set()
            self.pool.active_sessions -= 1
            metrics.ACTIVE_SESSIONS.dec()
            metrics.REQUESTS.labels(status=status).inc()
            task = asyncio.get_running_loop().create_task(self._clean_up(loop, sid))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    async def _clean_up(self, loop: RoundLoop, session_id: str) -> None:
        try:
            await loop.release(wait_s=self.settings.rpc_timeout_s)
        except Exception:
            log.exception("release_failed", session_id=session_id)
        with contextlib.suppress(errors.SpecServeError):
            await self.store.release_lease(session_id, self.owner)

    @property
    def active_sessions(self) -> int:
        return self._active

    async def drain(self) -> None:
        """Wait for the sessions in progress to end, then for their clean-up (health is NOT_SERVING)."""
        await self._idle.wait()
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        await self.pool.close()
        await self.store.close()


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
