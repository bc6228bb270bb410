"""The round loop of one session (DESIGN.md, "One round, step by step").

Each round: choose gamma (the policy), **Propose** to the session's draft
replica (sending only the committed tokens it has not seen), **Verify** through
the batcher of the session's target replica, then advance the session by the
committed verdict and hand the new tokens to the caller to stream.

Faults, and what a round does about them:

* **Draft down, slow or failing** (any error of the Propose call): the draft's
  circuit breaker opens for a back-off period and the round runs with
  gamma = 0 (a plain target decode step). A draft fault never fails a session.
  A draft that answers FAILED_PRECONDITION lacks earlier tokens (it lost or
  never had the session): the same call is resent once with all tokens from 0.
* **Target replica down** (UNAVAILABLE, connection refused, a worker bug): it
  is marked down and the same item, with the same ``(session, version)``, is
  sent to the next replica on the session's ring. That replica rebuilds the
  session from Redis; if the old replica had committed before dying, the new
  one answers with the recorded verdict (``replayed``), which is used exactly
  like a fresh one. A Verify past its deadline is treated the same way (a hung
  replica is left for the next one; safe because the item is idempotent per
  ``(session, version)``: whichever replica commits first, the other gets the
  recorded verdict). RESOURCE_EXHAUSTED is retried on the same replica. A
  failed batch opens its replica's breaker once (not once per session in it);
  while every replica is backing off the round waits for the first breaker to
  let a call through. The session fails with UNAVAILABLE after
  ``MAX_VERIFY_ATTEMPTS`` failed calls or ``MAX_ALL_DOWN_WAIT_S`` of waiting.
* **Stale version** (ABORTED) or **log mismatch** (FAILED_PRECONDITION): the
  session re-reads its log from Redis and continues from there, emitting only
  tokens it had not emitted.

Worker calls run as tasks shielded from the caller's cancellation and are
tracked, so that on cancellation :meth:`RoundLoop.release` waits for them to
finish before releasing the session's caches: a release never overtakes the
request that would re-create the cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import structlog

from coordinator.batcher import BatchedResult
from coordinator.policy import AcceptanceTracker, SpeculationPolicy
from coordinator.pool import WorkerPool
from coordinator.session import Session
from coordinator.workers import WorkerError
from specserve import errors, metrics
from specserve.store import SessionStore
from specserve.v1 import common_pb2, target_pb2

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: Attempts of one Verify item across replicas and retries before the session fails.
MAX_VERIFY_ATTEMPTS = 6
#: Longest a round waits, in all, while every target replica is backing off (above the
#: breaker's longest back-off, so a replica that recovers is tried before the session fails).
MAX_ALL_DOWN_WAIT_S = 15.0
ALL_DOWN_POLL_S = 0.25
#: Re-reads of the log in a row that bring no progress before the session fails (a bug guard).
MAX_FRUITLESS_RESYNCS = 3


class RoundLoop:
    """Drives one session's rounds; :meth:`step` runs one round and returns the new tokens."""

    def __init__(
        self,
        session: Session,
        *,
        pool: WorkerPool,
        store: SessionStore,
        policy: SpeculationPolicy,
        max_gamma: int,
    ) -> None:
        self.session = session
        self.pool = pool
        self.store = store
        self.policy = policy
        self.max_gamma = max_gamma
        self.acceptance = AcceptanceTracker()
        self._inflight: set[asyncio.Task] = set()
        self._drafts_used: set[str] = set()
        self._targets_used: set[str] = set()
        self._fruitless = 0
        self._network_ns = 0  # this round's Propose call time minus the draft's own account
        self._log = log.bind(session_id=session.session_id)

    # ---- plumbing ----------------------------------------------------------------------
    async def _shielded(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` in its own task that the caller's cancellation does not interrupt."""
        task = asyncio.ensure_future(awaitable)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    # ---- one round ---------------------------------------------------------------------
    def choose_gamma(self) -> int:
        s = self.session
        tokens_left = s.stop.max_new_tokens - (s.committed_len - s.prompt_len)
        gamma = self.policy.choose_gamma(self.acceptance, self.pool.load())
        gamma = max(0, min(gamma, tokens_left - 1, self.max_gamma))
        metrics.GAMMA_CHOSEN.observe(gamma)
        return gamma

    async def step(self) -> tuple[int, ...]:
        """One Propose/Verify round; returns the newly committed tokens (maybe none)."""
        s = self.session
        self.pool.assign(s.session_id, self.pool.targets.choose(s.session_id))
        gamma = self.choose_gamma()
        proposal = common_pb2.Proposal()
        self._network_ns = 0
        if gamma > 0:
            drafted = await self._propose(gamma)
            if drafted is not None:
                proposal = drafted
        item = target_pb2.VerifyItem(base=s.base.to_pb(), proposal=proposal)
        batched, item = await self._verify(item)
        proposed = len(item.proposal.token_ids)
        result = batched.item
        s.stats.verify_ns += batched.call_ns
        s.stats.queue_ns += batched.queue_ns
        _observe_stages(batched, self._network_ns)
        if result.verdict is not None:
            verdict = result.verdict
            new = s.apply_verdict(verdict)
            s.stats.observe_round(proposed=proposed, accepted=verdict.accepted_count)
            self.acceptance.observe(proposed=proposed, accepted=min(verdict.accepted_count, proposed))
            self._fruitless = 0
            _count_round(proposed, verdict.accepted_count, len(verdict.committed_token_ids))
            if result.replayed:
                self._log.info("verdict_replayed", version=verdict.new_version)
            return new
        return await self._resync(result.error)

    # ---- Propose ------------------------------------------------------------------------
    async def _propose(self, gamma: int) -> common_pb2.Proposal | None:
        s = self.session
        endpoint = self.pool.drafts.choose(s.session_id)
        if endpoint is None:
            return None  # every draft replica is backing off: gamma = 0
        client = self.pool.draft_clients[endpoint]
        self._drafts_used.add(endpoint)
        start_ns = time.perf_counter_ns()
        try:
            try:
                start, tokens = s.unseen_by_draft(endpoint)
                reply = await self._shielded(self._call_propose(client, start, tokens, gamma))
            except errors.FailedPrecondition:
                # The draft lacks tokens before start_position: resend everything.
                reply = await self._shielded(self._call_propose(client, 0, s.token_ids, gamma))
        except Exception as exc:  # any draft fault: this round runs at gamma = 0
            wall = time.perf_counter_ns() - start_ns
            s.stats.draft_ns += wall
            s.draft_endpoint = None
            backoff = self.pool.drafts.mark_failed(endpoint)
            metrics.REPLICA_FAILURES.labels(tier="draft").inc()
            self._log.warning(
                "draft_fault_gamma_0",
                endpoint=endpoint,
                error=type(exc).__name__,
                message=str(exc),
                backoff_s=backoff,
            )
            return None
        wall = time.perf_counter_ns() - start_ns
        s.stats.draft_ns += wall
        s.draft_caught_up(endpoint)
        self.pool.drafts.mark_ok(endpoint)
        n = len(reply.proposal.token_ids)
        cm = self.pool.cost_model
        cm.observe_draft(tokens=n, ns=reply.draft_ns, prefill_tokens=reply.prefill_tokens)
        cm.observe_rtt(ns=wall - reply.draft_ns, tokens=len(reply.proposal.distributions))
        metrics.STAGE_SECONDS.labels(stage="draft").observe(reply.draft_ns / 1e9)
        self._network_ns = max(0, wall - reply.draft_ns)
        if n > gamma:
            self._log.error("draft_overproposed", asked=gamma, got=n)
            return None
        return reply.proposal

    def _call_propose(self, client, start: int, tokens, gamma: int):
        s = self.session
        return client.propose(
            s.base,
            start_position=start,
            token_ids=tokens,
            sampling=s.sampling,
            gamma=gamma,
            proposer=s.speculation.proposer,
            draft_top_k=s.speculation.draft_top_k,
        )

    # ---- Verify -------------------------------------------------------------------------
    async def _verify(self, item: target_pb2.VerifyItem) -> tuple[BatchedResult, target_pb2.VerifyItem]:
        """Verify ``item`` on the session's replica, failing over; returns the result and the item sent.

        A batch refused as malformed (INVALID_ARGUMENT: one item's proposal is bad, e.g. a draft bug)
        commits nothing for anyone; each of its sessions then retries with an empty proposal
        (gamma = 0), which cannot be malformed, so a bad draft never fails the sessions it rode with.
        """
        s = self.session
        last_exc: Exception | None = None
        attempt = 0
        waited_s = 0.0
        while attempt < MAX_VERIFY_ATTEMPTS:
            endpoint = self.pool.targets.choose(s.session_id)
            if endpoint is None:
                # Every replica is backing off: wait (without spending an attempt) until a breaker
                # lets a call through, so a replica that recovers within its back-off is used.
                if waited_s >= MAX_ALL_DOWN_WAIT_S:
                    break
                await asyncio.sleep(ALL_DOWN_POLL_S)
                waited_s += ALL_DOWN_POLL_S
                continue
            attempt += 1
            self._targets_used.add(endpoint)
            self.pool.assign(s.session_id, endpoint)
            try:
                batched = await self._shielded(self.pool.batchers[endpoint].submit(item))
            except (errors.Unavailable, WorkerError, errors.Cancelled, errors.DeadlineExceeded) as exc:
                # Cancelled: by the server. DeadlineExceeded: the replica hangs; the item is idempotent.
                last_exc = exc
                if self.pool.targets.is_up(endpoint):  # one failed batch counts once, not once per session
                    self.pool.targets.mark_failed(endpoint)
                    metrics.REPLICA_FAILURES.labels(tier="target").inc()
                self._log.warning("target_failover", endpoint=endpoint, error=str(exc), version=s.version)
                continue
            except errors.InvalidArgument as exc:
                if not item.proposal.token_ids:
                    raise
                last_exc = exc
                self._log.error("verify_refused_proposal_gamma_0", endpoint=endpoint, error=exc.message)
                item = target_pb2.VerifyItem(base=item.base, proposal=common_pb2.Proposal())
                continue
            except errors.ResourceExhausted as exc:
                last_exc = exc
                self._log.warning("verify_retry", endpoint=endpoint, error=str(exc), version=s.version)
                await asyncio.sleep(0.05 * attempt)
                continue
            self.pool.targets.mark_ok(endpoint)
            return batched, item
        raise errors.Unavailable(
            f"no target replica could verify session {s.session_id} after {attempt} attempts"
            + (f" (last error: {last_exc})" if last_exc else ""),
            retry_after_s=1.0,
        )

    async def _resync(self, error: errors.SpecServeError | None) -> tuple[int, ...]:
        """After an item error: re-read the log from Redis and continue from there."""
        s = self.session
        if isinstance(error, errors.NotFound):
            raise errors.FailedPrecondition(
                f"session {s.session_id} vanished from Redis (expired?); start again"
            )
        if error is not None and not isinstance(error, (errors.Aborted, errors.FailedPrecondition)):
            raise error
        record = await self.store.load(s.session_id)
        new = s.advance(record.token_ids, start=0, version=record.version, finish_reason=record.finish_reason)
        s.stats.rounds += 1
        self._log.info(
            "resynced_from_log",
            error=type(error).__name__ if error else None,
            version=record.version,
            new=len(new),
        )
        if record.version == s.version and not new and not record.finished:
            self._fruitless += 1
            if self._fruitless >= MAX_FRUITLESS_RESYNCS:
                raise errors.FailedPrecondition(
                    f"session {s.session_id}: the target keeps refusing version {s.version} "
                    f"({error.message if error else 'no reason'})"
                )
        return new

    # ---- the end ------------------------------------------------------------------------
    def detach(self) -> None:
        """The session will start no more rounds: stop counting it in batch formation."""
        self.pool.assign(self.session.session_id, None)

    async def release(self, *, wait_s: float = 30.0) -> None:
        """Wait for calls in flight, then drop the session's caches on every worker it used."""
        self.pool.assign(self.session.session_id, None)
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=wait_s)
        sid = self.session.session_id
        calls = [self.pool.draft_clients[ep].release(sid) for ep in self._drafts_used]
        calls += [self.pool.target_clients[ep].release(sid) for ep in self._targets_used]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self._log.info("release_incomplete", errors=[type(e).__name__ for e in failed])


def _observe_stages(batched: BatchedResult, propose_network_ns: int) -> None:
    """Per-round stage times: queue (waiting for a batch), verify (the target's account), network (the rest)."""
    metrics.STAGE_SECONDS.labels(stage="queue").observe(batched.queue_ns / 1e9)
    metrics.STAGE_SECONDS.labels(stage="verify").observe(batched.verify_ns / 1e9)
    network_ns = propose_network_ns + max(0, batched.call_ns - batched.verify_ns)
    metrics.STAGE_SECONDS.labels(stage="network").observe(network_ns / 1e9)


def _count_round(proposed: int, accepted: int, committed: int) -> None:
    if proposed:
        metrics.SPEC_DRAFTS.inc()
        metrics.SPEC_DRAFT_TOKENS.inc(proposed)
        metrics.SPEC_ACCEPTED_TOKENS.inc(accepted)
        metrics.SPEC_WASTED_TOKENS.inc(proposed - accepted)
        for i in range(accepted):
            metrics.SPEC_ACCEPTED_PER_POS.labels(position=str(i)).inc()
    metrics.SPEC_ACCEPTED_LENGTH.observe(committed)
    metrics.COMMITTED_TOKENS.inc(committed)
