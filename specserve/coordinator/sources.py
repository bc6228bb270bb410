"""Where each round's proposal comes from, and what the proposers in the coordinator learn
(docs/design.md, "The hybrid lookup"; docs/internals.md, "One round, file by file").

One :class:`ProposalSources` per session decides, each round, in this order:

1. **forced text** (a constrained session whose grammar forces text now: ``Session.forced``): the
   policy is asked with the forced text's own acceptance, as a proposer in the coordinator; a gamma
   above 0 drafts the round from it;
2. **the hybrid lookup** (``Session.lookup``), the same way, once its guesses have been seen to match
   and it has a match now;
3. otherwise **the session's own choice**: the policy with the session's tracker, and at a gamma
   above 0 the first source that has tokens: the session's proposers in the coordinator (its
   prediction, the n-gram lookup); none when the session does not draft with a model, or its feature
   head has no features yet; the proposal drafted ahead during the last round (:mod:`specserve.coordinator.overlap`);
   else a Propose to the draft model (:meth:`WorkerPool.propose`).

Every gamma is capped by the tokens left and the server's largest gamma. Proposals in the coordinator
cost no call. Each proposer in the coordinator learns its acceptance from the rounds it drafts and,
for free, from its **shadow** in the others: what it would have drafted for the positions the round
committed (:meth:`ProposalSources.shadows`, :meth:`ProposalSources.learn`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.api.params import Verdict
from specserve.coordinator.fleet.pool import DRAFT_PROPOSERS, Proposed, WorkerPool
from specserve.coordinator.local_proposers import LocalProposer, NgramProposer
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.acceptance import AcceptanceTracker
from specserve.coordinator.speculation.policy import SpeculationPolicy
from specserve.engine.kvcache import common_prefix_len
from specserve.runtime import metrics
from specserve.v1 import common_pb2


@dataclass(frozen=True)
class Choice:
    """A round's gamma and, when the policy chose it for the round, the proposer in the coordinator
    that drafts it (the forced text or the hybrid lookup; None: the session's own choice)."""

    gamma: int
    local: LocalProposer | None = None
    forced: bool = False  # ``local`` is the forced text
    lookup: bool = False  # ``local`` is the hybrid lookup


@dataclass(frozen=True)
class Shadows:
    """What the proposers in the coordinator would have drafted for a round's positions (see
    :meth:`ProposalSources.shadows`); ``()`` where there is nothing to learn from."""

    session: tuple[int, ...] = ()  # at gamma 0: the session's own proposers in the coordinator
    lookup: tuple[int, ...] = ()  # the hybrid lookup, when it did not draft the round
    forced: tuple[int, ...] = ()  # the forced text, when it did not draft the round


class ProposalSources:
    """One session's proposal sources: the choice of each round's, and their acceptance trackers."""

    def __init__(self, session: Session, *, pool: WorkerPool, policy: SpeculationPolicy, max_gamma: int) -> None:
        self.session = session
        self.pool = pool
        self.policy = policy
        self.max_gamma = max_gamma
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
        #: every round for free (:meth:`learn`), so it starts from a cautious prior: the lookup drafts
        #: once its guesses have been seen to match, and a request whose text never repeats pays nothing.
        self.lookup_acceptance = AcceptanceTracker(prior_alpha=0.3) if session.lookup is not None else None
        #: The hybrid lookup has had a guess seen to match (in its shadow or in a round it drafted): it
        #: drafts no round before that, so a request whose text never repeats spends nothing on it.
        self.lookup_matched = False
        #: The forced-text proposer's own acceptance (None: the session has no constraint). Forced text is
        #: what the grammar allows alone, so the target's own tokens usually spell it: a confident prior,
        #: and it learns from every round (the rounds it drafts, and its shadow in the others). Its
        #: proposals cost no draft call, so it opens at the best rung for that prior (``warm_start``), as a
        #: session of a proposer in the coordinator does, and falls at once where the guess is wrong.
        self.forced_acceptance = AcceptanceTracker(prior_alpha=0.9) if session.forced is not None else None
        if self.forced_acceptance is not None:
            self.forced_acceptance.warm_start = True

    # ---- choose ----------------------------------------------------------------------------
    def choose(self) -> Choice:
        """The next round's gamma and proposer in the coordinator (see the module's order, steps 1-3)."""
        s = self.session
        load = self.pool.load()
        forced = s.forced
        if forced is not None and self.forced_acceptance is not None and forced.ready:
            zero_steps = self.steps(_NO_PROPOSAL)
            gamma = self._capped(
                self.policy.choose_gamma(self.forced_acceptance, load, local_draft=True, zero_steps=zero_steps)
            )
            if gamma > 0:
                metrics.GAMMA_CHOSEN.observe(gamma)
                return Choice(gamma, forced, forced=True)
        lookup = s.lookup
        if lookup is not None and self.lookup_acceptance is not None and self.lookup_matched and lookup.ready:
            zero_steps = self.steps(_NO_PROPOSAL)
            gamma = self._capped(
                self.policy.choose_gamma(self.lookup_acceptance, load, local_draft=True, zero_steps=zero_steps)
            )
            if gamma > 0:
                metrics.GAMMA_CHOSEN.observe(gamma)
                return Choice(gamma, lookup, lookup=True)
        gamma = self._capped(self.policy.choose_gamma(self.acceptance, load, local_draft=self.pool.drafts_locally(s)))
        metrics.GAMMA_CHOSEN.observe(gamma)
        return Choice(gamma)

    def _capped(self, gamma: int) -> int:
        s = self.session
        tokens_left = s.stop.max_new_tokens - (s.committed_len - s.prompt_len)
        return max(0, min(gamma, tokens_left - 1, self.max_gamma))

    def steps(self, proposal: common_pb2.Proposal, decode_steps: int = 1) -> int:
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
        return max(1, min(decode_steps, s.stop.max_new_tokens - generated))

    # ---- propose ---------------------------------------------------------------------------
    async def propose(self, choice: Choice, *, ahead: common_pb2.Proposal | None = None) -> Proposed:
        """The round's proposal from the first source that has one (none: the round runs at gamma = 0).

        ``ahead``: a proposal drafted during the last round for exactly this prefix (overlap), used
        in place of a Propose call, cut to the gamma. Only a draft-model proposal makes a call
        (:meth:`WorkerPool.propose`); every other round is bound to its replicas here."""
        s, gamma = self.session, choice.gamma
        if gamma > 0 and choice.local is not None:
            self.pool.bind_round(s)
            return _propose_locally((choice.local,), gamma) or Proposed(common_pb2.Proposal())
        if gamma == 0:
            self.pool.bind_round(s)
            return Proposed(common_pb2.Proposal())
        local = _propose_locally(s.local_proposers, gamma)
        if local is not None or s.speculation.proposer not in DRAFT_PROPOSERS:
            self.pool.bind_round(s)
            return local or Proposed(common_pb2.Proposal())
        if s.features is not None and not s.features.ready(s.committed_len):
            # The feature head has no features yet (the first round: the target's prefill brings them).
            self.pool.bind_round(s)
            return Proposed(common_pb2.Proposal())
        if ahead is not None and ahead.token_ids:
            self.pool.bind_round(s)
            metrics.PROPOSALS.labels(proposer="model").inc()
            return Proposed(_first(ahead, gamma), source="model")
        return await self.pool.propose(s, gamma)

    # ---- learn -----------------------------------------------------------------------------
    def shadows(self, choice: Choice, proposed: common_pb2.Proposal, steps: int) -> Shadows:
        """What the proposers in the coordinator would have drafted for the positions this round commits.

        At gamma 0, the session's own proposers in the coordinator offer their guess for the round's
        ``steps`` target steps (a lookup: no call, no position verified). The target's tokens then say how
        many would have been accepted: a proposal of certain tokens ``x_1..x_k`` has ``x_i`` accepted with
        probability ``p_i(x_i)``, the probability that the target's own token there is ``x_i`` (greedy:
        whether it is the argmax; coupled: whether the one Gumbel-max sample is ``x_i``), so the guess's
        longest prefix equal to the committed tokens is what a round proposing it would have accepted.
        So a session whose local proposer offers a guess learns its acceptance at gamma 0 for free, and
        starts speculating as soon as its text turns to copying, instead of waiting for a probe. The
        hybrid lookup and the forced text, when they do not draft the round, guess for every position the
        round commits, and their trackers learn the same way."""
        s = self.session
        session: tuple[int, ...] = ()
        if choice.gamma == 0:
            session = next((t for t in (p.peek(steps) for p in s.local_proposers) if t), ())
        positions = len(proposed.token_ids) + steps
        lookup = s.lookup.peek(positions) if s.lookup is not None and not choice.lookup else ()
        forced = s.forced.peek(positions) if s.forced is not None and not choice.forced else ()
        return Shadows(session=session, lookup=lookup, forced=forced)

    def learn(self, verdict: Verdict, *, choice: Choice, proposed: int, shadows: Shadows) -> None:
        """A verdict into the trackers: the one whose source drafted the round (the forced text's, the
        hybrid lookup's, or the session's, which alone feeds the pooled acceptance: the draft model's),
        and each shadow's. A round at gamma 0 with a shadow teaches the session's tracker that shadow
        (the stats and the pooled acceptance count proposals actually verified)."""
        accepted = min(verdict.accepted_count, proposed)
        committed = verdict.committed_token_ids
        if choice.forced:
            assert self.forced_acceptance is not None
            self.forced_acceptance.observe(proposed=proposed, accepted=accepted)
        elif choice.lookup:
            self._lookup_learns(proposed=proposed, accepted=accepted)
        elif shadows.session and not proposed and committed:
            self.acceptance.observe(**_shadow_outcome(shadows.session, committed))
        else:
            self.acceptance.observe(proposed=proposed, accepted=accepted)
            self.pool.observe_acceptance(self.speculation_key, proposed=proposed, accepted=accepted)
        if shadows.lookup and committed:
            self._lookup_learns(**_shadow_outcome(shadows.lookup, committed))
        if shadows.forced and committed and self.forced_acceptance is not None:
            self.forced_acceptance.observe(**_shadow_outcome(shadows.forced, committed))

    def _lookup_learns(self, *, proposed: int, accepted: int) -> None:
        """One outcome of the hybrid lookup's guesses (a round it drafted, or its shadow) into its tracker."""
        assert self.lookup_acceptance is not None
        self.lookup_acceptance.observe(proposed=proposed, accepted=accepted)
        self.lookup_matched = self.lookup_matched or accepted > 0


#: A round's proposal when it has none (read only).
_NO_PROPOSAL = common_pb2.Proposal()


def _propose_locally(proposers: Sequence[LocalProposer], gamma: int) -> Proposed | None:
    """The first proposal one of ``proposers`` in the coordinator offers (None: none offers any)."""
    start_ns = time.perf_counter_ns()
    for proposer in proposers:
        tokens = proposer.propose(gamma)
        if tokens:
            metrics.PROPOSALS.labels(proposer=proposer.name).inc()
            return Proposed(
                common_pb2.Proposal(token_ids=tokens),
                wall_ns=time.perf_counter_ns() - start_ns,
                source=proposer.name,
            )
    return None


def _first(proposal: common_pb2.Proposal, n: int) -> common_pb2.Proposal:
    """The first ``n`` tokens of a proposal, with their distributions."""
    out = common_pb2.Proposal(token_ids=proposal.token_ids[:n])
    out.distributions.extend(proposal.distributions[:n])
    return out


def _shadow_outcome(guess: tuple[int, ...], committed: Sequence[int]) -> dict[str, int]:
    """What a round proposing ``guess`` would have accepted, given the tokens it committed without it:
    the guess's longest prefix equal to them (:meth:`ProposalSources.shadows`), as
    ``AcceptanceTracker.observe`` arguments."""
    guess = guess[: len(committed)]
    return {"proposed": len(guess), "accepted": common_prefix_len(guess, committed)}


def lookup_drafted(proposed: Proposed) -> bool:
    """An n-gram lookup drafted the round (the hybrid lookup or the ``ngram`` proposer), for the stats."""
    return proposed.source == NgramProposer.name
