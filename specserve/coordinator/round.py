"""The round loop of one session (docs/design.md, "One round, step by step").

:meth:`RoundLoop.step` reads as one round:

1. **choose**: :meth:`ProposalSources.choose <specserve.coordinator.sources.ProposalSources.choose>`, the round's
   gamma and, when the policy chose one, the proposer in the coordinator that drafts it;
2. **propose**: :meth:`ProposalSources.propose <specserve.coordinator.sources.ProposalSources.propose>`, from the
   first source that has a proposal (a proposer in the coordinator, the proposal drafted ahead during
   the last round, :mod:`specserve.coordinator.overlap`, or the draft model through :meth:`WorkerPool.propose`;
   none: the round runs at gamma = 0);
3. **verify**: :meth:`WorkerPool.verify` (batched, failing over), with the next round drafted ahead
   beside it when overlap is on (:class:`~specserve.coordinator.overlap.Overlap`);
4. **apply the verdict**: advance the session by the committed tokens and hand them (with their log
   probabilities, when the session asked for them) to the caller to stream; the sources' trackers
   learn from it (:meth:`ProposalSources.learn <specserve.coordinator.sources.ProposalSources.learn>`), the stats
   count it.

Replicas, failover, breakers and the cost model are the pool's
(:mod:`specserve.coordinator.fleet.pool`); the round loop uses only the pool's public methods.
What it handles itself is the session's state:

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
from specserve.coordinator.fleet.batcher import BatchedResult
from specserve.coordinator.fleet.clients import ItemReply
from specserve.coordinator.fleet.pool import Proposed, Verified, WorkerPool
from specserve.coordinator.overlap import Overlap
from specserve.coordinator.session import Session
from specserve.coordinator.sources import Choice, ProposalSources, Shadows, lookup_drafted
from specserve.coordinator.speculation.acceptance import AcceptanceTracker
from specserve.coordinator.speculation.policy import SpeculationPolicy
from specserve.runtime import metrics
from specserve.runtime.store import SessionStore
from specserve.v1 import common_pb2, target_pb2

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

    def __init__(
        self,
        session: Session,
        *,
        pool: WorkerPool,
        store: SessionStore,
        policy: SpeculationPolicy,
        max_gamma: int,
        overlap: bool = False,
        decode_steps: int = 1,
    ) -> None:
        self.session = session
        self.pool = pool
        self.store = store
        self.decode_steps = decode_steps
        self.sources = ProposalSources(session, pool=pool, policy=policy, max_gamma=max_gamma)
        self.overlap = Overlap(session, pool=pool, enabled=overlap, max_gamma=max_gamma)
        self._fruitless = 0
        self._log = log.bind(session_id=session.session_id)
        pool.attach(session)

    # ---- one round ---------------------------------------------------------------------
    async def step(self) -> Committed:
        """One round: choose, propose, verify, apply the verdict; returns what it newly committed."""
        ahead = self.overlap.take()
        choice = self.sources.choose()
        proposed = await self.sources.propose(choice, ahead=ahead)
        self.overlap.count(ahead, proposed)
        steps = self.sources.steps(proposed.proposal, self.decode_steps)
        shadows = self.sources.shadows(choice, proposed.proposal, steps)
        result, item = await self._verify_round(proposed, steps)
        if result.verdict is None:
            return await self._resync(result.error)
        return self._apply(result, choice=choice, proposed=proposed, sent=item, shadows=shadows)

    async def _verify_round(self, proposed: Proposed, steps: int) -> tuple[ItemReply, target_pb2.VerifyItem]:
        """The round's verify phase, the next round drafted ahead beside it (overlap): ``(the item's
        result, the item as last sent)``; the draft's and the verify's times into the stats."""
        s = self.session
        s.stats.draft_ns += proposed.wall_ns
        if proposed.draft_ns is not None:
            metrics.STAGE_SECONDS.labels(stage="draft").observe(proposed.draft_ns / 1e9)
        item = target_pb2.VerifyItem(
            base=s.base.to_pb(), proposal=proposed.proposal, decode_steps=steps, cache_scope=s.cache_scope
        )
        if s.top_logprobs is not None:
            item.logprobs.CopyFrom(common_pb2.LogprobsParams(top_logprobs=s.top_logprobs))
        if s.features is not None:  # the feature head drafts from the target's features of these positions
            ask = s.features.ask()
            item.features_from = ask.start
            item.features_from_uncached = ask.uncached
            item.features_max_bytes = ask.max_bytes
        drafting = self.overlap.start(proposed)
        try:
            batched, item = await self._verify(item, drafted=proposed.source == "model" and proposed.wall_ns > 0)
        except BaseException:
            Overlap.cancel(drafting)
            raise
        await self.overlap.finish(drafting, tuple(proposed.proposal.token_ids), batched.item.verdict)
        s.stats.verify_ns += batched.call_ns
        s.stats.queue_ns += batched.queue_ns
        s.stats.target_ns += batched.verify_ns
        s.stats.forward_ns += batched.forward_ns
        _observe_stages(batched, proposed.network_ns)
        return batched.item, item

    async def _verify(self, item: target_pb2.VerifyItem, *, drafted: bool = False) -> Verified:
        """The round's verify call: ``(batched result, the item as last sent)``. ``drafted``: the
        proposal came from a Propose call made in this round (for the cost model's batcher wait)."""
        return await self.pool.verify(self.session, item, drafted=drafted)

    def _apply(
        self,
        result: ItemReply,
        *,
        choice: Choice,
        proposed: Proposed,
        sent: target_pb2.VerifyItem,
        shadows: Shadows,
    ) -> Committed:
        """Advance the session by the round's committed verdict; returns its new tokens.

        ``sent``: the item as last sent (the pool drops a proposal the target refused, so the tokens
        proposed are counted from it); the sources' trackers learn from the verdict
        (:meth:`ProposalSources.learn`), and the stats count the round."""
        s = self.session
        verdict = result.verdict
        assert verdict is not None
        if s.stats.rounds == 0:  # the verdict of the call that prefilled the prompt
            s.stats.cached_tokens = min(result.cached_tokens, s.prompt_len)
        if result.features is not None:
            metrics.FEATURE_BYTES.labels(hop="from_target").inc(len(result.features.data))
            if s.features is not None:
                s.features.add(result.features)
        new = self._committed(verdict, s.apply_verdict(verdict))
        count = len(sent.proposal.token_ids)
        s.stats.observe_round(
            proposed=count, accepted=verdict.accepted_count, lookup=lookup_drafted(proposed), forced=choice.forced
        )
        self.sources.learn(verdict, choice=choice, proposed=count, shadows=shadows)
        self._fruitless = 0
        _count_round(count, verdict.accepted_count, len(verdict.committed_token_ids))
        if result.replayed:
            self._log.info("verdict_replayed", version=verdict.new_version)
        return new

    # ---- what the sources and the overlap keep, by the names callers read ----------------
    def choose_gamma(self) -> int:
        """The next round's gamma (:meth:`ProposalSources.choose`)."""
        return self.sources.choose().gamma

    @property
    def acceptance(self) -> AcceptanceTracker:
        """The session's own acceptance tracker (the draft model's, or its proposer's)."""
        return self.sources.acceptance

    @acceptance.setter
    def acceptance(self, tracker: AcceptanceTracker) -> None:
        self.sources.acceptance = tracker

    @property
    def lookup_acceptance(self) -> AcceptanceTracker | None:
        return self.sources.lookup_acceptance

    @property
    def forced_acceptance(self) -> AcceptanceTracker | None:
        return self.sources.forced_acceptance

    @property
    def speculation_key(self) -> str:
        return self.sources.speculation_key

    @property
    def ahead_used(self) -> int:
        return self.overlap.used

    @property
    def ahead_wasted(self) -> int:
        return self.overlap.wasted

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
