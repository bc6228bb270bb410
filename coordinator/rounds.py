"""The round loop of one session (docs/design.md, "One round, step by step").

:meth:`RoundLoop.step` only sequences one round:

1. **choose gamma**: the policy's choice for the session's acceptance and the
   pool's load, capped by the tokens left and the server's largest gamma;
2. **propose**: :meth:`WorkerPool.propose`, which decides where the proposal
   comes from (a proposer in the coordinator, or the draft model; none: the
   round runs at gamma = 0);
3. **verify**: :meth:`WorkerPool.verify` (batched, failing over);
4. **apply the verdict**: advance the session by the committed tokens and hand
   them (with their log probabilities, when the session asked for them) to
   the caller to stream; update the session's acceptance and stats.

Replicas, failover, breakers and the cost model are the pool's
(:mod:`coordinator.pool`); the round loop uses only the pool's public methods.
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

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from coordinator.acceptance import AcceptanceTracker
from coordinator.batcher import BatchedResult
from coordinator.local_proposers import LocalProposer, NgramProposer
from coordinator.policy import SpeculationPolicy
from coordinator.pool import Verified, WorkerPool
from coordinator.session import Session
from coordinator.worker_clients import ItemReply
from specserve.api import errors
from specserve.api.params import PositionLogprobs, Verdict
from specserve.engine.kvcache import common_prefix_len
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
        self.policy = policy
        self.max_gamma = max_gamma
        self.overlap = overlap
        self.decode_steps = decode_steps
        #: Overlap: the next round's proposal, drafted while this round was verified, valid only for
        #: this committed prefix (the hypothesis it was drafted on).
        self._ahead: tuple[tuple[int, ...], common_pb2.Proposal] | None = None
        #: Overlap: rounds whose proposal was drafted ahead, and ahead drafts thrown away.
        self.ahead_used = self.ahead_wasted = 0
        #: What this session's acceptance is pooled under, across sessions (the pool's memory of it).
        self.speculation_key = "/".join(
            (
                str(session.speculation.proposer),
                "+".join(p.name for p in session.local_proposers),
                "greedy" if session.sampling.greedy else "sampled",
            )
        )
        # A local proposer's acceptance (n-gram, a prediction) is a property of the text, not of the pair:
        # pooled over chat and over copied code it describes neither, and a session started from it at
        # gamma 0 on a costly verify curve would not find its own text's high acceptance in time. Such a
        # session starts from the tracker's own prior, probes on its own clock, and (its proposals cost no
        # draft call) may open at the best rung of the whole ladder for that prior, falling at once if its
        # text is not repeated.
        prior = None if session.local_proposers else pool.acceptance_prior(self.speculation_key)
        if prior is None:
            self.acceptance = AcceptanceTracker()
            self.acceptance.warm_start = bool(session.local_proposers)
        else:
            self.acceptance = AcceptanceTracker(prior_alpha=prior, prior_weight=8.0)
            self.acceptance.warm_start = True
            self.acceptance.probe_clock = pool.probe_clock(self.speculation_key)
        #: The hybrid lookup's own acceptance (None: the session has no hybrid lookup). It learns from
        #: every round for free (:meth:`_apply`), so it starts from a cautious prior: the lookup drafts
        #: once its guesses have been seen to match, and a request whose text never repeats pays nothing.
        self.lookup_acceptance = AcceptanceTracker(prior_alpha=0.3) if session.lookup is not None else None
        #: The hybrid lookup has had a guess seen to match (in its shadow or in a round it drafted): it
        #: drafts no round before that, so a request whose text never repeats spends nothing on it.
        self._lookup_matched = False
        #: The forced-text proposer's own acceptance (None: the session has no constraint). Forced text is
        #: what the grammar allows alone, so the target's own tokens usually spell it: a confident prior,
        #: and it learns from every round (the rounds it drafts, and its shadow in the others). Its
        #: proposals cost no draft call, so it opens at the best rung for that prior (``warm_start``), as a
        #: session of a proposer in the coordinator does, and falls at once where the guess is wrong.
        self.forced_acceptance = AcceptanceTracker(prior_alpha=0.9) if session.forced is not None else None
        if self.forced_acceptance is not None:
            self.forced_acceptance.warm_start = True
        self._fruitless = 0
        self._log = log.bind(session_id=session.session_id)
        pool.attach(session)

    # ---- one round ---------------------------------------------------------------------
    def choose_gamma(self) -> int:
        """The next round's gamma (see :meth:`_choose`)."""
        return self._choose()[0]

    def _choose(self) -> tuple[int, LocalProposer | None]:
        """``(gamma, the proposer in the coordinator chosen for the round)``: the policy's choice for the next
        round, capped by the tokens left and the server's largest gamma.

        A constrained session whose grammar forces text now (``Session.forced``) asks the policy first with
        the forced-text proposer's own acceptance, as a proposer in the coordinator; a gamma above 0 there
        drafts the round from the forced text.

        A session with a hybrid lookup (``Session.lookup``) asks the policy first with the lookup's own
        acceptance, as a proposer in the coordinator (no draft call), whenever the lookup has a match;
        a gamma above 0 there drafts the round from the lookup. Otherwise the session's own tracker and
        proposer decide, as for any session. So the draft model keeps the rounds where the text is not
        repeating, and a copied run is drafted from the lookup, whose rounds cost no draft call and may
        go to any rung (docs/design.md, "The hybrid lookup")."""
        s = self.session
        load = self.pool.load()
        forced = s.forced
        if forced is not None and self.forced_acceptance is not None and forced.ready:
            zero_steps = self._steps(_NO_PROPOSAL)
            gamma = self._capped(
                self.policy.choose_gamma(self.forced_acceptance, load, local_draft=True, zero_steps=zero_steps)
            )
            if gamma > 0:
                metrics.GAMMA_CHOSEN.observe(gamma)
                return gamma, forced
        lookup = s.lookup
        if lookup is not None and self.lookup_acceptance is not None and self._lookup_matched and lookup.ready:
            zero_steps = self._steps(_NO_PROPOSAL)
            gamma = self._capped(
                self.policy.choose_gamma(self.lookup_acceptance, load, local_draft=True, zero_steps=zero_steps)
            )
            if gamma > 0:
                metrics.GAMMA_CHOSEN.observe(gamma)
                return gamma, lookup
        gamma = self._capped(self.policy.choose_gamma(self.acceptance, load, local_draft=self.pool.drafts_locally(s)))
        metrics.GAMMA_CHOSEN.observe(gamma)
        return gamma, None

    def _capped(self, gamma: int) -> int:
        s = self.session
        tokens_left = s.stop.max_new_tokens - (s.committed_len - s.prompt_len)
        return max(0, min(gamma, tokens_left - 1, self.max_gamma))

    async def step(self) -> Committed:
        """One round: choose gamma, propose, verify, apply the verdict; returns what it newly committed."""
        s = self.session
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] != s.token_ids:  # the log moved otherwise (a resync): useless
            ahead = None
        gamma, local = self._choose()
        from_lookup = local is not None and local is s.lookup
        from_forced = local is not None and local is s.forced
        if local is not None:
            proposed = await self.pool.propose(s, gamma, lookup=local)
        else:
            proposed = await self.pool.propose(s, gamma, ahead=ahead[1] if ahead else None)
        if ahead is not None and proposed.wall_ns == 0 and proposed.source == "model":
            self.ahead_used += 1
            metrics.OVERLAP_DRAFTS.labels(outcome="used").inc()
        s.stats.draft_ns += proposed.wall_ns
        if proposed.draft_ns is not None:
            metrics.STAGE_SECONDS.labels(stage="draft").observe(proposed.draft_ns / 1e9)
        steps = self._steps(proposed.proposal)
        shadow = self._shadow(steps) if gamma == 0 else ()
        # What the hybrid lookup would have drafted for the positions this round commits (when it does
        # not draft the round itself): its tracker learns from that for free, as a local proposer's at 0.
        lookup_shadow = (
            s.lookup.peek(len(proposed.proposal.token_ids) + steps)
            if s.lookup is not None and not from_lookup
            else ()
        )
        # The same for the forced text (what the grammar forced at the committed tokens).
        forced_shadow = (
            s.forced.peek(len(proposed.proposal.token_ids) + steps) if s.forced is not None and not from_forced else ()
        )
        item = target_pb2.VerifyItem(base=s.base.to_pb(), proposal=proposed.proposal, decode_steps=steps)
        if s.top_logprobs is not None:
            item.logprobs.CopyFrom(common_pb2.LogprobsParams(top_logprobs=s.top_logprobs))
        if s.features is not None:  # the feature head drafts from the target's features of these positions
            item.features_from = s.features.ask_from()
        drafting = None
        if self.overlap and proposed.source == "model" and proposed.proposal.token_ids:
            # While the target verifies, the draft drafts the next round as if all of this one is accepted.
            gamma = len(proposed.proposal.token_ids)
            drafting = self.pool.propose_ahead(
                s, proposed.proposal.token_ids, min(gamma + 1, self.max_gamma + 1)
            )
        try:
            batched, item = await self._verify(
                item, drafted=proposed.source == "model" and proposed.wall_ns > 0
            )
        except BaseException:
            if drafting is not None:
                drafting.cancel()
            raise
        if drafting is not None:
            await self._keep_ahead(drafting, tuple(proposed.proposal.token_ids), batched.item.verdict)
        s.stats.verify_ns += batched.call_ns
        s.stats.queue_ns += batched.queue_ns
        s.stats.target_ns += batched.verify_ns
        s.stats.forward_ns += batched.forward_ns
        _observe_stages(batched, proposed.network_ns)
        if batched.item.verdict is None:
            return await self._resync(batched.item.error)
        if s.stats.rounds == 0:  # the verdict of the call that prefilled the prompt
            s.stats.cached_tokens = min(batched.item.cached_tokens, s.prompt_len)
        if s.features is not None and batched.item.features is not None:
            s.features.add(batched.item.features)
        return self._apply(
            batched.item,
            proposed=len(item.proposal.token_ids),
            shadow=shadow,
            lookup_shadow=lookup_shadow,
            from_lookup=from_lookup,
            lookup_drafted=proposed.source == NgramProposer.name,
            forced_shadow=forced_shadow,
            from_forced=from_forced,
        )

    def _steps(self, proposal: common_pb2.Proposal) -> int:
        """Target steps the round asks for: ``decode_steps`` for a round without a proposal once the first
        token is out (the first round is the prefill: its token goes out alone, as soon as it exists),
        capped by the tokens left, for a session whose proposals need a draft call; 1 otherwise. Each
        step commits what a gamma = 0 round would; the call saves the round trips, the commits and the
        coordinator's share of the steps after the first."""
        s = self.session
        generated = s.committed_len - s.prompt_len
        if proposal.token_ids or generated == 0 or self.pool.drafts_locally(s):
            # A session whose proposals come from the coordinator (n-gram lookup, a prediction) keeps one
            # step per round: they are free, so every round is its chance to start drafting a copied run.
            return 1
        return max(1, min(self.decode_steps, s.stop.max_new_tokens - generated))

    def _shadow(self, steps: int) -> tuple[int, ...]:
        """At gamma 0, the tokens the session's local proposers would offer now for the round's ``steps``
        target steps (a lookup: no call, no position verified). The target's tokens then say how many
        would have been accepted: a proposal of certain tokens ``x_1..x_k`` has ``x_i`` accepted with
        probability ``p_i(x_i)``, the probability that the target's own token there is ``x_i`` (greedy:
        whether it is the argmax; coupled: whether the one Gumbel-max sample is ``x_i``), so the guess's
        longest prefix equal to the committed tokens is what a round proposing it would have accepted.
        So a session whose local proposer offers a guess learns its acceptance at gamma 0 for free, and
        starts speculating as soon as its text turns to copying, instead of waiting for a probe.
        ``()``: no local proposer, or none offers a token."""
        for proposer in self.session.local_proposers:
            tokens = proposer.peek(steps)
            if tokens:
                return tokens
        return ()

    async def _keep_ahead(
        self,
        drafting: asyncio.Task[common_pb2.Proposal | None],
        proposal: tuple[int, ...],
        verdict: Verdict | None,
    ) -> None:
        """Keep the ahead draft for the next round when the verdict bears its hypothesis out.

        The hypothesis: every proposed token accepted and the bonus token equal to the draft's first
        token. Then the draft drafted the rest after exactly the prefix the session now holds, with
        the same position-keyed randomness: it is the proposal a Propose would return now (waiting
        for it, when it is still drafting, costs less than a new call). Otherwise it is cancelled or
        thrown away, and the next Propose resends the whole prefix (the draft recorded the
        hypothetical one; a full resend does not depend on the order the two requests arrive in).
        """
        s = self.session
        all_in = (
            verdict is not None
            and not verdict.finish_reason
            and verdict.accepted_count == len(proposal)
            and len(verdict.committed_token_ids) == len(proposal) + 1
        )
        ready = None
        if all_in:
            # A draft still under way is awaited (cheaper than a new call): the round waits on the draft
            # tier for it, as it would for a Propose, and the stats count that wait as the draft's.
            start_ns = time.perf_counter_ns()
            ready = await drafting
            s.stats.draft_ns += time.perf_counter_ns() - start_ns
        if not drafting.done():
            drafting.cancel()
        if (
            verdict is not None
            and ready is not None
            and len(ready.token_ids) > 1
            and (ready.token_ids[0] == verdict.committed_token_ids[-1])
        ):
            rest = common_pb2.Proposal(token_ids=ready.token_ids[1:])
            rest.distributions.extend(ready.distributions[1:])
            self._ahead = (s.token_ids + tuple(verdict.committed_token_ids), rest)
        else:
            self.ahead_wasted += 1
            metrics.OVERLAP_DRAFTS.labels(outcome="wasted").inc()
            s.draft_lost()

    async def _verify(self, item: target_pb2.VerifyItem, *, drafted: bool = False) -> Verified:
        """The round's verify phase: ``(batched result, the item as last sent)``. ``drafted``: the
        proposal came from a Propose call made in this round (for the cost model's batcher wait)."""
        return await self.pool.verify(self.session, item, drafted=drafted)

    def _apply(
        self,
        result: ItemReply,
        *,
        proposed: int,
        shadow: tuple[int, ...] = (),
        lookup_shadow: tuple[int, ...] = (),
        from_lookup: bool = False,
        lookup_drafted: bool = False,
        forced_shadow: tuple[int, ...] = (),
        from_forced: bool = False,
    ) -> Committed:
        """Advance the session by a committed (fresh or replayed) verdict; returns its new tokens.

        ``shadow``: at gamma 0, what the local proposers would have offered (:meth:`_shadow`); the
        session's own acceptance tracker learns from it (only it: the stats and the pooled
        acceptance count proposals actually verified). ``lookup_shadow``: what the hybrid lookup
        would have offered for the round's positions, which its tracker learns from the same way;
        ``from_lookup``: the round drafted from the hybrid lookup, so its tracker, not the
        session's, learns from the verdict (and the pooled acceptance, the draft model's, does not);
        ``lookup_drafted``: an n-gram lookup drafted the round (the hybrid lookup or the ``ngram``
        proposer), for the stats. ``forced_shadow`` and ``from_forced``: the same for the forced-text
        proposer and its own tracker."""
        s = self.session
        verdict = result.verdict
        assert verdict is not None
        new = self._committed(verdict, s.apply_verdict(verdict))
        s.stats.observe_round(
            proposed=proposed, accepted=verdict.accepted_count, lookup=lookup_drafted, forced=from_forced
        )
        accepted = min(verdict.accepted_count, proposed)
        if from_forced:
            assert self.forced_acceptance is not None
            self.forced_acceptance.observe(proposed=proposed, accepted=accepted)
        elif from_lookup:
            self._lookup_learns(proposed=proposed, accepted=accepted)
        elif shadow and not proposed and verdict.committed_token_ids:
            self.acceptance.observe(**_shadow_outcome(shadow, verdict.committed_token_ids))
        else:
            self.acceptance.observe(proposed=proposed, accepted=accepted)
            self.pool.observe_acceptance(self.speculation_key, proposed=proposed, accepted=accepted)
        if lookup_shadow and verdict.committed_token_ids:
            self._lookup_learns(**_shadow_outcome(lookup_shadow, verdict.committed_token_ids))
        if forced_shadow and verdict.committed_token_ids and self.forced_acceptance is not None:
            self.forced_acceptance.observe(**_shadow_outcome(forced_shadow, verdict.committed_token_ids))
        self._fruitless = 0
        _count_round(proposed, verdict.accepted_count, len(verdict.committed_token_ids))
        if result.replayed:
            self._log.info("verdict_replayed", version=verdict.new_version)
        return new

    def _lookup_learns(self, *, proposed: int, accepted: int) -> None:
        """One outcome of the hybrid lookup's guesses (a round it drafted, or its shadow) into its tracker."""
        assert self.lookup_acceptance is not None
        self.lookup_acceptance.observe(proposed=proposed, accepted=accepted)
        self._lookup_matched = self._lookup_matched or accepted > 0

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


#: A round's proposal when it has none (read only).
_NO_PROPOSAL = common_pb2.Proposal()


def _shadow_outcome(guess: tuple[int, ...], committed: Sequence[int]) -> dict[str, int]:
    """What a round proposing ``guess`` would have accepted, given the tokens it committed without it:
    the guess's longest prefix equal to them (``RoundLoop._shadow``), as ``AcceptanceTracker.observe``
    arguments."""
    guess = guess[: len(committed)]
    return {"proposed": len(guess), "accepted": common_prefix_len(guess, committed)}


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
