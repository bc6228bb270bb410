"""The round loop of one session: :meth:`RoundLoop.step` plans, proposes, verifies, learns and applies one
round (docs/design.md, "One round, step by step"). What the loop handles itself is the session's state:

* **Stale version** (ABORTED) or **log mismatch** (FAILED_PRECONDITION) for the
  item: the session re-reads its log from Redis and continues from there,
  emitting only tokens it had not emitted. A session gone from Redis fails
  with FAILED_PRECONDITION; after ``MAX_FRUITLESS_RESYNCS`` re-reads in a row
  that bring nothing new it fails too (a guard against a bug looping). The
  log holds tokens, not log probabilities: a session that reports them takes
  those of the new tokens from the last verdict recorded with the log, which
  covers them when one commit is all it missed (the only case a single owner
  of the session can meet); otherwise it fails with FAILED_PRECONDITION rather
  than stream tokens without them.
* **The end**: :meth:`RoundLoop.detach` as soon as no round will start, and
  :meth:`RoundLoop.release` (the pool waits for the session's calls in flight,
  then drops its caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from specserve.api import errors
from specserve.api.params import PositionLogprobs, Verdict
from specserve.coordinator.fleet.pool import WorkerPool
from specserve.coordinator.messages import CallCost, Proposal, Verified, VerifyRequest
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.speculator import Speculator
from specserve.runtime import metrics
from specserve.runtime.store import SessionStore

log = structlog.get_logger(__name__)

#: Re-reads of the log in a row that bring no progress before the session fails (a bug guard).
MAX_FRUITLESS_RESYNCS = 3


@dataclass(frozen=True)
class Committed:
    """What one round committed that the session had not emitted: tokens, and their logprobs if asked."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token when the session reports logprobs


class RoundLoop:
    """Drives one session's rounds; :meth:`step` runs one round and returns what it newly committed."""

    def __init__(self, session: Session, speculator: Speculator, *, pool: WorkerPool, store: SessionStore) -> None:
        self.session = session
        self.speculator = speculator
        self.pool = pool
        self.store = store
        self._fruitless = 0
        self._log = log.bind(session_id=session.session_id)
        pool.attach(session)

    # ---- one round ---------------------------------------------------------------------
    async def step(self) -> Committed:
        """One round: plan, propose, verify, learn, apply; returns what it newly committed."""
        plan = self.speculator.plan()
        proposal = await self.speculator.propose(plan)
        request = self.speculator.request(plan, proposal)
        verified = await self.speculator.beside(request, self._verify(request))
        if verified.verdict is None:
            return await self._resync(verified.error)
        self.speculator.learn(plan, request, verified)
        return self._apply(verified)

    async def _verify(self, request: VerifyRequest) -> Verified:
        """The round's verify call; the draft's and the verify's times into the stats."""
        s, proposal = self.session, request.proposal
        s.stats.draft_ns += proposal.wall_ns
        if proposal.draft_ns is not None:
            metrics.STAGE_SECONDS.labels(stage="draft").observe(proposal.draft_ns / 1e9)
        verified = await self.pool.verify(s, request, drafted=proposal.from_call)
        cost = verified.cost
        s.stats.verify_ns += cost.call_ns
        s.stats.queue_ns += cost.queue_ns
        s.stats.target_ns += cost.verify_ns
        s.stats.forward_ns += cost.forward_ns
        _observe_stages(cost, proposal)
        return verified

    def _apply(self, verified: Verified) -> Committed:
        """Advance the session by the round's committed verdict; returns its new tokens. The tokens proposed are
        counted from the item as last sent (the pool drops a proposal the target refused)."""
        s = self.session
        verdict = verified.verdict
        assert verdict is not None
        if s.stats.rounds == 0:  # the verdict of the call that prefilled the prompt
            s.stats.cached_tokens = min(verified.cached_tokens, s.prompt_len)
        new = self._committed(verdict, s.apply_verdict(verdict))
        sent = verified.request.proposal
        count = len(sent.token_ids)
        s.stats.observe_round(
            proposed=count, accepted=verdict.accepted_count, source=sent.source, levels=sent.depth
        )
        self._fruitless = 0
        _count_round(count, verdict.accepted_count, len(verdict.committed_token_ids), sent.source)
        if verified.replayed:
            self._log.info("verdict_replayed", version=verdict.new_version)
        return new

    def _check_logprobs(self, verdict: Verdict) -> None:
        """A session that reports logprobs needs one per committed token (an older target sends none)."""
        if self.session.top_logprobs is not None and len(verdict.logprobs) != len(
            verdict.committed_token_ids
        ):
            raise errors.FailedPrecondition(
                f"session {self.session.session_id}: the target sent {len(verdict.logprobs)} logprobs for "
                f"{len(verdict.committed_token_ids)} committed tokens; is it older than the logprobs API?"
            )

    def _committed(self, verdict: Verdict | None, new: tuple[int, ...]) -> Committed:
        """``new`` (the tail of ``verdict``'s tokens) with its logprobs from the verdict when the session asks."""
        if self.session.top_logprobs is None or not new:
            return Committed(new)
        if verdict is None or tuple(verdict.committed_token_ids[-len(new) :]) != new:
            raise errors.FailedPrecondition(
                f"session {self.session.session_id}: {len(new)} tokens were committed without this coordinator "
                "seeing their verdict, so their logprobs are not known; start again"
            )
        self._check_logprobs(verdict)
        return Committed(new, verdict.logprobs[-len(new) :])

    async def _resync(self, error: errors.SpecServeError | None) -> Committed:
        """After an item error: re-read the log from Redis and continue from there."""
        s = self.session
        if isinstance(error, errors.NotFound):
            raise errors.FailedPrecondition(
                f"session {s.session_id} vanished from Redis (expired?); start again"
            )
        if error is not None and not isinstance(error, (errors.Aborted, errors.FailedPrecondition)):
            raise error
        record = await self.store.load(s.session_id)
        last = record.last_verdict  # the commit that made the log's current version
        if last is not None and last.new_version != record.version:
            last = None
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
        return self._committed(last, new)

    # ---- the end ------------------------------------------------------------------------
    def detach(self) -> None:
        """The session will start no more rounds: stop counting it in the load and batch formation."""
        self.pool.detach(self.session)

    async def release(self, *, wait_s: float = 30.0) -> None:
        """Wait for calls in flight, then drop the session's caches on every worker it used."""
        await self.pool.release(self.session, wait_s=wait_s)


def _observe_stages(cost: CallCost, proposal: Proposal) -> None:
    """Per-round stage times: queue (waiting for a batch), verify (the target's account), network (the rest)."""
    metrics.STAGE_SECONDS.labels(stage="queue").observe(cost.queue_ns / 1e9)
    metrics.STAGE_SECONDS.labels(stage="verify").observe(cost.verify_ns / 1e9)
    network_ns = proposal.network_ns + max(0, cost.call_ns - cost.verify_ns)
    metrics.STAGE_SECONDS.labels(stage="network").observe(network_ns / 1e9)


def _count_round(proposed: int, accepted: int, committed: int, source: str) -> None:
    if proposed:
        metrics.SOURCE_TOKENS.labels(source=source, outcome="proposed").inc(proposed)
        metrics.SOURCE_TOKENS.labels(source=source, outcome="accepted").inc(accepted)
        metrics.SPEC_DRAFTS.inc()
        metrics.SPEC_DRAFT_TOKENS.inc(proposed)
        metrics.SPEC_ACCEPTED_TOKENS.inc(accepted)
        metrics.SPEC_WASTED_TOKENS.inc(proposed - accepted)
        for i in range(accepted):
            metrics.SPEC_ACCEPTED_PER_POS.labels(position=str(i)).inc()
    metrics.SPEC_ACCEPTED_LENGTH.observe(committed)
    metrics.COMMITTED_TOKENS.inc(committed)
