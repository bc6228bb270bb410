"""Draft trees from the draft's own ranking: the budget a round sends and the tree a draft grows under it.

The draft drafts its chain as always; at each depth the next-best tokens of its distribution there (distinct
from the chain's token) are candidate siblings of the chain's token, point masses (docs/design.md, "Draft trees
from the draft's ranking"). :func:`grow_tree` keeps the candidates whose path probability (the draft's
probabilities of the chain's tokens above, times the candidate's own) is at least the budget's threshold, best
first, while the tree has fewer nodes than the budget. Each candidate's token and existence follow from the
chain's tokens and the draft's distributions alone, never from the target, so every tree rule stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.api.errors import InvalidArgument
from specserve.core.tree import MAX_TREE_NODES

#: One candidate sibling at a depth: its token and the draft's probability of it there.
Candidate = tuple[int, float]


@dataclass(frozen=True)
class TreeBudget:
    """How far a round's proposal may branch: at most ``max_nodes`` nodes in all (the chain included; 0 or not
    above the chain's length: a chain), an alternative only at a path probability of ``min_path_probability``
    or more (1: a chain)."""

    max_nodes: int = 0
    min_path_probability: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_nodes <= MAX_TREE_NODES:
            raise InvalidArgument(f"tree_max_nodes={self.max_nodes} must be in [0, {MAX_TREE_NODES}]")
        if not 0.0 <= self.min_path_probability <= 1.0:  # NaN fails both comparisons
            raise InvalidArgument(
                f"tree_min_path_probability={self.min_path_probability} must be in [0, 1] (1: a chain)"
            )

    @property
    def branches(self) -> bool:
        """Whether any alternative may be added (else the proposal is a chain)."""
        return self.max_nodes > 1 and self.min_path_probability < 1.0


#: No branching: the proposal is a chain.
CHAIN = TreeBudget()


def grow_tree(
    chain: Sequence[int],
    chain_probs: Sequence[float],
    candidates: Sequence[Sequence[Candidate]],
    budget: TreeBudget,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(tokens, parents)`` of the tree: the chain's tokens, then the kept candidates (module docstring).

    ``chain_probs[d]``: the draft's probability of ``chain[d]`` at depth ``d + 1``; ``candidates[d]``: the
    candidates there, distinct from ``chain[d]`` and from each other. A candidate at depth ``d + 1`` hangs below
    ``chain[d - 1]`` (the root at depth 1), after the chain's token: siblings in the order the verifier tries
    them. ``parents`` is ``()`` when nothing is kept (a chain). Ties keep the shallower, then the earlier listed.
    """
    if len(chain_probs) != len(chain) or len(candidates) > len(chain):
        raise ValueError("one probability per chain token and at most one candidate list per depth")
    room = budget.max_nodes - len(chain)
    if not budget.branches or room <= 0:
        return tuple(chain), ()
    scored: list[tuple[float, int, int, int]] = []  # (-path probability, depth index, rank, token)
    above = 1.0
    for d, listed in enumerate(candidates):
        for rank, (token, prob) in enumerate(listed):
            path = above * prob
            if path >= budget.min_path_probability and path > 0.0 and not math.isnan(path):
                scored.append((-path, d, rank, token))
        above *= chain_probs[d]
    kept = sorted(sorted(scored)[:room], key=lambda s: (s[1], s[2]))  # grouped by depth, best first
    if not kept:
        return tuple(chain), ()
    tokens = (*chain, *(token for _, _, _, token in kept))
    parents = (*range(-1, len(chain) - 1), *(d - 1 for _, d, _, _ in kept))
    return tuple(int(t) for t in tokens), tuple(parents)
