"""The draft model's chain with the n-gram lookup's continuation as a free branch: a draft tree, opt-in
(``opt_in_sources=tree``; docs/design.md, "Draft trees: exact acceptance").

Each round the draft model drafts its chain as the :class:`~specserve.coordinator.speculation.sources.draft_model.
DraftModel` source would, and the lookup over the session's own tokens (:class:`specserve.core.ngram.NgramIndex`)
offers its continuation for nothing. Where the two agree the chain already holds it; where they part, the rest of
the lookup hangs below the last token they share, a later sibling of the chain's token there. Every lookup node is
a point mass that depends only on the committed tokens and on the chain's tokens before it (drawn earlier), so
each tree rule stays exact (the preconditions of the design note); the target verifies the tree in one pass. The
round loop sees a proposal like any other: a tree is a proposal with parents. No overlap drafting: the next round
is drafted after the verdict.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence

from specserve.api.params import PROPOSER_KINDS
from specserve.coordinator.messages import Proposal, Verified
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.source import Fleet, Source, SourceSetup
from specserve.coordinator.speculation.sources.draft_model import DraftModel
from specserve.core.ngram import NgramIndex
from specserve.core.ranked_tree import CHAIN, TreeBudget


class ModelLookupTree(DraftModel):
    """The draft model's chain, and the lookup's continuation where it parts from it (module docstring)."""

    name = "tree"
    opt_in = True

    def __init__(self, session: Session, fleet: Fleet, prompt_token_ids: Iterable[int]) -> None:
        super().__init__(session, fleet)
        self._index = NgramIndex(prompt_token_ids, max_n=3, min_n=1)

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        if not applies(setup):
            return None
        return cls(setup.session, setup.fleet, setup.request.prompt_token_ids)

    def observe(self, tokens: Sequence[int]) -> None:
        self._index.extend(tokens)

    async def propose(self, gamma: int, tree: TreeBudget = CHAIN) -> Proposal:
        return (await super().propose(gamma)).with_branch(self._index.lookup(gamma))

    async def beside(self, proposal: Proposal, verifying: Awaitable[Verified]) -> Verified:
        return await verifying


def applies(setup: SourceSetup) -> bool:
    """Opted in, a draft-model session without a constraint (a constrained session's proposal is a chain)."""
    return (
        ModelLookupTree.name in setup.settings.opt_in_sources
        and setup.request.speculation.proposer == PROPOSER_KINDS["model"]
        and setup.matcher is None
    )
