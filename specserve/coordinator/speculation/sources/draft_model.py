"""The draft model: a Propose call to the session's draft replica, batched with other sessions' (through the fleet).

With overlap (``CoordinatorSettings.overlap``), while the target verifies a round the model drafted, the draft
drafts the next one as if the whole proposal is accepted (docs/design.md, "Overlap"). The next round uses that
draft, with no call, when the verdict bears the hypothesis out: every proposed token accepted and the bonus token
equal to the draft's first. Then the draft drafted the rest after exactly the prefix the session now holds, with
the same position-keyed randomness: it is the proposal a Propose would return now. Otherwise it is cancelled or
thrown away, and the next Propose resends the whole prefix (the draft recorded the hypothetical one). A draft
ahead never fails a round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from specserve.api.params import PROPOSER_KINDS, Verdict
from specserve.coordinator.messages import Proposal, Verified, VerifyRequest
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.source import Fleet, Source, SourceSetup
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.runtime import metrics


class DraftModel(Source):
    """The small draft model, and its proposal drafted ahead (module docstring)."""

    name = "model"
    free = False

    def __init__(self, session: Session, fleet: Fleet, *, overlap: bool = False, max_gamma: int = 0) -> None:
        super().__init__()
        self.session = session
        self.fleet = fleet
        self.overlap = overlap
        self.max_gamma = max_gamma
        #: The next round's proposal, drafted while this round was verified, valid only for this committed
        #: prefix (the hypothesis it was drafted on).
        self._next_proposal: tuple[tuple[int, ...], Proposal] | None = None
        #: Rounds whose proposal was drafted ahead, and ahead drafts thrown away.
        self.used = self.wasted = 0

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        if setup.request.speculation.proposer != PROPOSER_KINDS["model"]:
            return None
        if "tree" in setup.settings.opt_in_sources and setup.matcher is None:
            return None  # the tree source drafts the session's chains (sources/tree.py)
        return cls(setup.session, setup.fleet, overlap=setup.settings.overlap, max_gamma=setup.max_gamma)

    def ready(self) -> bool:
        return True

    async def propose(self, gamma: int, tree: TreeBudget = CHAIN) -> Proposal:
        """A chain (its draft ahead hypothesises the whole chain accepted); ``tree`` is not read."""
        drafted, self._next_proposal = self._next_proposal, None
        if drafted is not None and drafted[0] == self.session.token_ids:
            self.used += 1
            metrics.OVERLAP_DRAFTS.labels(outcome="used").inc()
            return drafted[1].first(gamma)
        return await self.fleet.propose(self.session, gamma)

    def ask(self, request: VerifyRequest) -> VerifyRequest:
        self._next_proposal = None  # a draft ahead is for the round after the one it was drafted beside, only
        return request

    async def beside(self, proposal: Proposal, verifying: Awaitable[Verified]) -> Verified:
        """The round's verify, with the next round drafted ahead beside it."""
        drafting = self._start(proposal)
        try:
            verified = await verifying
        except BaseException:
            if drafting is not None:
                drafting.cancel()
            raise
        await self._finish(drafting, proposal.token_ids, verified.verdict)
        return verified

    def _start(self, proposal: Proposal) -> asyncio.Task[Proposal | None] | None:
        if not (self.overlap and proposal.token_ids):
            return None
        gamma = len(proposal.token_ids)
        return self.fleet.propose_ahead(self.session, proposal.token_ids, min(gamma + 1, self.max_gamma + 1))

    async def _finish(
        self, drafting: asyncio.Task[Proposal | None] | None, proposal: tuple[int, ...], verdict: Verdict | None
    ) -> None:
        """Keep the draft ahead for the next round when the verdict bears its hypothesis out (module docstring)."""
        if drafting is None:
            return
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
        if verdict is not None and ready is not None and len(ready.token_ids) > 1:
            if ready.token_ids[0] == verdict.committed_token_ids[-1]:
                rest = Proposal(ready.token_ids[1:], ready.distributions[1:])
                self._next_proposal = (s.token_ids + tuple(verdict.committed_token_ids), rest)
                return
        self.wasted += 1
        metrics.OVERLAP_DRAFTS.labels(outcome="wasted").inc()
        s.draft_lost()
