"""One session's speculation: its sources, each round's gamma and drafter, and what each verdict teaches.

:meth:`Speculator.plan` asks the sources with a tracker of their own first, then the policy on the session's
tracker for its proposers; :meth:`Speculator.propose` takes the drafter's proposal; :meth:`Speculator.learn`
feeds the drafter's tracker and, for free, every other source's shadow (docs/design.md, "Proposal sources").
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specserve.coordinator.messages import NO_PROPOSAL, Proposal, Verified, VerifyRequest
from specserve.coordinator.requests import GenerationRequest
from specserve.coordinator.session import Session, SourceStats
from specserve.coordinator.speculation.acceptance import AcceptanceMemory, AcceptanceTracker
from specserve.coordinator.speculation.policy import LoadSnapshot, SpeculationPolicy
from specserve.coordinator.speculation.source import Fleet, Source, SourceSetup
from specserve.coordinator.speculation.sources import SOURCES
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.core.tree import MAX_TREE_NODES
from specserve.engine.kvcache import common_prefix_len
from specserve.runtime import metrics
from specserve.runtime.config import CoordinatorSettings


@dataclass(frozen=True)
class Plan:
    """A round's gamma and, where one with a tracker of its own takes the round, its source (None: the session's
    proposers), how far a proposer that drafts trees may branch, and whether the policy drafts it only to probe
    out of gamma 0 (the round then goes on with a gamma-0 round's target steps)."""

    gamma: int
    source: Source | None = None
    tree: TreeBudget = CHAIN
    probe: bool = False


class Speculator:
    """One session's sources, in order, and the trackers they learn with (see the module docstring)."""

    def __init__(
        self,
        session: Session,
        sources: Sequence[Source],
        *,
        fleet: Fleet,
        policy: SpeculationPolicy,
        max_gamma: int,
        memory: AcceptanceMemory | None = None,
        decode_steps: int = 1,
        tree_nodes: int = 0,
        tree_min_path_probability: float | None = None,
    ) -> None:
        self.session = session
        self.sources = tuple(sources)
        self.fleet = fleet
        self.policy = policy
        self.max_gamma = max_gamma
        self.memory = memory if memory is not None else AcceptanceMemory()
        self.decode_steps = decode_steps
        #: Most alternatives a tree adds to the chain (0: chains), and the path probability that fixes the
        #: policy's threshold (None: the policy's).
        self.tree_nodes = tree_nodes
        self.tree_min_path_probability = tree_min_path_probability
        self._own = tuple(s for s in self.sources if s.tracker is not None)  # asked first, with their trackers
        self._proposers = tuple(s for s in self.sources if s.tracker is None)  # share the session's tracker
        local = [s.name for s in self._proposers if s.free]
        #: What the session's acceptance is pooled under, across sessions.
        self.speculation_key = "/".join(
            (str(session.speculation.proposer), "+".join(local), "greedy" if session.sampling.greedy else "sampled")
        )
        # Acceptance of a proposer in the coordinator (n-gram, a prediction) is a property of the text, not of the
        # pair: such a session starts from the tracker's own prior and, its proposals costing no call, may open
        # at the best rung of the ladder for it, falling at once if its text is not repeated.
        prior = None if local else self.memory.prior(self.speculation_key)
        if prior is None:
            self.tracker = AcceptanceTracker()
            self.tracker.warm_start = bool(local)
        else:
            self.tracker = AcceptanceTracker(prior_alpha=prior, prior_weight=8.0)
            self.tracker.warm_start = True
            self.tracker.probe_clock = self.memory.probe_clock(self.speculation_key)
        for source in self.sources:
            session.stats.sources.setdefault(source.name, SourceStats())
        session.follow(self.observe)

    @classmethod
    def build(
        cls,
        session: Session,
        request: GenerationRequest,
        *,
        fleet: Fleet,
        settings: CoordinatorSettings,
        policy: SpeculationPolicy,
        max_gamma: int,
        memory: AcceptanceMemory | None = None,
        matcher: Any = None,
        encode: Any = None,
    ) -> Speculator:
        """The session's speculator with every registered source that applies to it (``SOURCES``)."""
        setup = SourceSetup(session, request, fleet, settings, max_gamma, matcher=matcher, encode=encode)
        chosen = (c for c in SOURCES if not c.opt_in or c.name in settings.opt_in_sources)
        sources = [s for s in (c.build(setup) for c in chosen) if s is not None]
        return cls(
            session,
            sources,
            fleet=fleet,
            policy=policy,
            max_gamma=max_gamma,
            memory=memory,
            decode_steps=settings.decode_steps,
            tree_nodes=settings.draft_tree_nodes,
            tree_min_path_probability=settings.draft_tree_min_path_probability,
        )

    def source(self, name: str) -> Source | None:
        """The session's source called ``name`` (None: it has none)."""
        return next((s for s in self.sources if s.name == name), None)

    # ---- plan ------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The next round's gamma and, where one with a tracker of its own takes it, its source."""
        load = self.fleet.load()
        for source in self._own:
            if source.ready():
                assert source.tracker is not None
                steps = self._target_steps(0)
                choice = self.policy.choose_gamma(
                    source.tracker, load, local_draft=source.free, target_only_steps=steps
                )
                gamma = self._capped(choice)
                if gamma > 0:
                    metrics.GAMMA_CHOSEN.observe(gamma)
                    return Plan(gamma, source)
        gamma = self._capped(self.policy.choose_gamma(self.tracker, load, local_draft=self._local()))
        metrics.GAMMA_CHOSEN.observe(gamma)
        return Plan(gamma, tree=self._tree(gamma, load), probe=gamma > 0 and self.tracker.probing)

    def _tree(self, gamma: int, load: LoadSnapshot) -> TreeBudget:
        """How far the round's proposal may branch (docs/design.md, "Draft trees from the draft's ranking"): a
        chain at gamma 0, with trees off, for a constrained session (its masks walk a chain) or where no proposer
        drafts trees; else up to ``tree_nodes`` alternatives at the policy's thresholds (or the fixed one, which
        expands any alternative it admits)."""
        if gamma == 0 or self.tree_nodes == 0 or self.session.sampling.constraint is not None:
            return CHAIN
        if not any(source.trees for source in self._proposers):
            return CHAIN
        threshold, expand = self.tree_min_path_probability, 0.0
        if threshold is None:
            threshold = self.policy.tree_min_path_probability(self.tracker, load, gamma)
            expand = self.policy.tree_expand_min_path_probability(self.tracker, load, gamma)
        tree = TreeBudget(min(gamma + self.tree_nodes, MAX_TREE_NODES), threshold, expand)
        return tree if tree.branches else CHAIN

    def _capped(self, gamma: int) -> int:
        s = self.session
        tokens_left = s.stop.max_new_tokens - (s.committed_len - s.prompt_len)
        return max(0, min(gamma, tokens_left - 1, self.max_gamma))

    def _local(self) -> bool:
        """Whether the session's next proposal needs no draft call (no model cost: the policy's question)."""
        return all(s.free for s in self._proposers) or any(s.free and s.ready() for s in self._proposers)

    def _target_steps(self, proposed: int, *, probe: bool = False) -> int:
        """Target steps a round asks for: ``decode_steps`` for a round without a proposal once the first token is
        out (the first round is the prefill: its token goes out alone, as soon as it exists), or with a probe's
        (the policy would run gamma 0 but for the probe, so the call goes on as a gamma-0 round would: the probe
        costs its drafted positions, not a round), capped by the tokens left, for a session whose proposals
        need a draft call; 1 otherwise (a drafted round's verdict decides the next round; a free proposal is
        every round's chance to start drafting a copied run)."""
        s = self.session
        generated = s.committed_len - s.prompt_len
        if (proposed and not probe) or generated == 0 or self._local():
            return 1
        return max(1, min(self.decode_steps, s.stop.max_new_tokens - generated - proposed))

    # ---- propose ---------------------------------------------------------------------------
    async def propose(self, plan: Plan) -> Proposal:
        """The round's proposal from its drafter: the plan's source, else the first of the session's proposers
        with tokens (none: the round runs at gamma 0). The round is bound to its replicas first."""
        self.fleet.bind_round(self.session)
        if plan.gamma == 0:
            return NO_PROPOSAL
        proposal = NO_PROPOSAL
        for source in (plan.source,) if plan.source is not None else self._proposers:
            start_ns = time.perf_counter_ns()
            proposal = await source.propose(plan.gamma, plan.tree)
            if proposal.token_ids:
                proposal = self._with_branches(proposal, plan, source)
                metrics.PROPOSALS.labels(proposer=source.name).inc()
                wall_ns = time.perf_counter_ns() - start_ns if source.free else proposal.wall_ns
                return replace(proposal, source=source.name, wall_ns=wall_ns)
        return proposal

    def _with_branches(self, proposal: Proposal, plan: Plan, drafter: Source) -> Proposal:
        """The drafter's tree with the other sources' free guesses hung on it (:meth:`Source.branch`: each
        priced against the round's threshold itself; the node budget is the draft's alternatives'); the proposal
        itself where the round does not branch (docs/design.md, "Free branches"). Each guess depends on the
        committed tokens alone: a point mass, so every tree rule stays exact."""
        if not (drafter.trees and plan.tree.branches):
            return proposal
        for source in self.sources:
            if source is drafter:
                continue
            guess = source.branch(plan.gamma, plan.tree.min_path_probability)
            branched = proposal.with_branch(guess, MAX_TREE_NODES - len(proposal.token_ids))
            added = len(branched.token_ids) - len(proposal.token_ids)
            if added:
                metrics.BRANCH_NODES.labels(source=source.name).inc(added)
            proposal = branched
        return proposal

    def request(self, plan: Plan, proposal: Proposal) -> VerifyRequest:
        """The round's Verify item: its proposal after the committed prefix, with what each source asks for."""
        s = self.session
        request = VerifyRequest(
            s.base,
            proposal,
            decode_steps=self._target_steps(len(proposal.token_ids), probe=plan.probe),
            top_logprobs=s.top_logprobs,
            cache_scope=s.cache_scope,
        )
        for source in self.sources:
            request = source.ask(request)
        return request

    async def beside(self, request: VerifyRequest, verifying: Awaitable[Verified]) -> Verified:
        """The round's verify, with its drafter's own work beside it (the draft model drafts the next round,
        except after a probe's: target steps follow its verdict, so no draft made ahead could be used)."""
        proposal = request.proposal
        drafter = self.source(proposal.source) if proposal.source and request.decode_steps == 1 else None
        return await (drafter.beside(proposal, verifying) if drafter is not None else verifying)

    # ---- learn -----------------------------------------------------------------------------
    def learn(self, plan: Plan, request: VerifyRequest, verified: Verified) -> None:
        """A verdict, before the session takes its tokens, into the trackers (module docstring) and the sources.

        ``request``: the round's item as built (its shadows cover its positions); ``verified.request``: as last
        sent (without the proposal the target refused), which says what was proposed."""
        verdict = verified.verdict
        assert verdict is not None
        proposed = verified.request.proposal.depth  # a tree's levels: a round accepts at most that many
        accepted = min(verdict.accepted_count, proposed)
        committed = verdict.committed_token_ids
        if plan.source is not None:
            plan.source.learn(proposed=proposed, accepted=accepted)
        else:
            # At gamma 0 the session's own proposers in the coordinator offer their guess for the round's steps.
            guess = self._guess(request.decode_steps) if plan.gamma == 0 else ()
            if guess and not proposed and committed:
                self.tracker.observe(**_shadow_outcome(guess, committed))
            else:
                self.tracker.observe(proposed=proposed, accepted=accepted)
                self.memory.observe(self.speculation_key, proposed=proposed, accepted=accepted)
        positions = request.proposal.depth + request.decode_steps
        for source in self._own:
            shadow = source.shadow(positions) if source is not plan.source else ()
            if shadow and committed:
                source.learn(**_shadow_outcome(shadow, committed))
        for source in self.sources:
            source.verified(verified)

    def _guess(self, n: int) -> tuple[int, ...]:
        return next((t for t in (s.shadow(n) for s in self._proposers if s.free) if t), ())

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens the session just committed, to every source (the session calls this, in order)."""
        for source in self.sources:
            source.observe(tokens)


def _shadow_outcome(guess: tuple[int, ...], committed: Sequence[int]) -> dict[str, int]:
    """What a round proposing ``guess`` would have accepted, given the tokens it committed without it: the guess's
    longest prefix equal to them, as ``AcceptanceTracker.observe`` arguments."""
    guess = guess[: len(committed)]
    return {"proposed": len(guess), "accepted": common_prefix_len(guess, committed)}
