"""Draft trees from the draft's own ranking: the budget a round sends and the tree a draft grows under it.

The draft drafts its chain as always; at each depth the next-best tokens of its distribution there (distinct
from the chain's token) are candidate siblings of the chain's token, point masses (docs/design.md, "Draft trees
from the draft's ranking"). :func:`grow_tree` keeps the candidates whose path probability (the draft's
probabilities of the chain's tokens above, times the candidate's own) is at least the budget's threshold, best
first, while the tree has fewer nodes than the budget. A draft that expands candidates (the feature head,
EAGLE-2's expansion) adds the candidates below each, named by :data:`Key`, one level deeper: ranked in the same
forest by path probability. Each candidate's token and existence follow from the chain's tokens and the draft's
distributions alone, never from the target, so every tree rule stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specserve.api.errors import InvalidArgument
from specserve.core.tree import MAX_TREE_NODES

#: One candidate sibling at a depth: its token and the draft's probability of it there.
Candidate = tuple[int, float]


@dataclass(frozen=True)
class TreeBudget:
    """How far a round's proposal may branch: at most ``max_nodes`` nodes in all (the chain included; 0 or not
    above the chain's length: a chain), an alternative only at a path probability of ``min_path_probability``
    or more (1: a chain); a proposer that expands alternatives (EAGLE-2: one more draft pass per level) runs such
    a pass only when the path probabilities of the alternatives it expands sum to ``expand_min_path_probability``
    or more (0: any pass; 1: none)."""

    max_nodes: int = 0
    min_path_probability: float = 1.0
    expand_min_path_probability: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_nodes <= MAX_TREE_NODES:
            raise InvalidArgument(f"tree_max_nodes={self.max_nodes} must be in [0, {MAX_TREE_NODES}]")
        if not 0.0 <= self.min_path_probability <= 1.0:  # NaN fails both comparisons
            raise InvalidArgument(
                f"tree_min_path_probability={self.min_path_probability} must be in [0, 1] (1: a chain)"
            )
        if not 0.0 <= self.expand_min_path_probability <= 1.0:
            raise InvalidArgument(
                f"tree_expand_min_path_probability={self.expand_min_path_probability} must be in [0, 1] "
                "(0: any expansion pass, 1: none)"
            )

    @property
    def branches(self) -> bool:
        """Whether any alternative may be added (else the proposal is a chain)."""
        return self.max_nodes > 1 and self.min_path_probability < 1.0

    def expands(self, path_probability: float) -> bool:
        """Whether a pass may expand alternatives whose path probabilities sum to ``path_probability`` (what
        their children can add to the round is at most that)."""
        return self.expand_min_path_probability < 1.0 and path_probability >= self.expand_min_path_probability


#: No branching: the proposal is a chain.
CHAIN = TreeBudget()


#: A candidate's name in a tree being grown: ``(d, r)`` for the ``r``-th candidate at depth ``d + 1`` beside the
#: chain, ``key + (c,)`` for the ``c``-th candidate below the one named ``key`` (one level deeper).
Key = tuple[int, ...]
#: One scored candidate: ``(-path probability, depth index, key, token)``; sorted, the best path first (ties: the
#: shallower, then the earlier listed).
Scored = tuple[float, int, Key, int]


def score_candidates(
    chain_probs: Sequence[float],
    candidates: Sequence[Sequence[Candidate]],
    budget: TreeBudget,
    below: Mapping[Key, Sequence[Candidate]] | None = None,
) -> list[Scored]:
    """Every candidate whose path probability passes ``budget``'s threshold, best first (:func:`grow_tree`'s
    arguments). A candidate's path probability is the draft's probability of each node above it times its own:
    a child's is at most its parent's, so it ranks after it, and one below a failing parent fails too."""
    below = below or {}
    scored: list[Scored] = []

    def visit(key: Key, depth: int, token: int, path: float) -> None:
        if not (path >= budget.min_path_probability and path > 0.0 and not math.isnan(path)):
            return
        scored.append((-path, depth, key, token))
        for c, (child, prob) in enumerate(below.get(key, ())):
            visit((*key, c), depth + 1, child, path * prob)

    above = 1.0
    for d, listed in enumerate(candidates):
        for rank, (token, prob) in enumerate(listed):
            visit((d, rank), d, token, above * prob)
        above *= chain_probs[d]
    return sorted(scored)


def grow_tree(
    chain: Sequence[int],
    chain_probs: Sequence[float],
    candidates: Sequence[Sequence[Candidate]],
    budget: TreeBudget,
    below: Mapping[Key, Sequence[Candidate]] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(tokens, parents)`` of the tree: the chain's tokens, then the kept candidates (module docstring).

    ``chain_probs[d]``: the draft's probability of ``chain[d]`` at depth ``d + 1``; ``candidates[d]``: the
    candidates there, distinct from ``chain[d]`` and from each other. A candidate at depth ``d + 1`` hangs below
    ``chain[d - 1]`` (the root at depth 1), after the chain's token: siblings in the order the verifier tries
    them. ``below[key]`` (EAGLE-2's expansion): the candidates below the candidate named ``key`` (:data:`Key`),
    one level deeper, distinct from each other, each with the draft's probability of it there; none deeper than
    the chain. The best ``max_nodes - len(chain)`` candidates by path probability are kept
    (:func:`score_candidates`), a child only below its kept parent. Nodes are listed depth by depth: a depth's
    chain siblings first, best first, then the candidates below that depth's parents, in the parents' order,
    each parent's best first. ``parents`` is ``()`` when nothing is kept (a chain).
    """
    if len(chain_probs) != len(chain) or len(candidates) > len(chain):
        raise ValueError("one probability per chain token and at most one candidate list per depth")
    room = budget.max_nodes - len(chain)
    if not budget.branches or room <= 0:
        return tuple(chain), ()
    kept = score_candidates(chain_probs, candidates, budget, below)[:room]
    if any(depth >= len(chain) for _, depth, _, _ in kept):
        raise ValueError("a candidate below another is deeper than the chain")
    if not kept:
        return tuple(chain), ()
    index: dict[Key, int] = {}  # a kept candidate's key -> its node index
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    for depth in sorted({s[1] for s in kept}):  # parents (one level up) are indexed before their children
        at_depth = [(key, token) for _, d, key, token in kept if d == depth]
        at_depth.sort(key=lambda kt: (len(kt[0]) > 2, index[kt[0][:-1]] if len(kt[0]) > 2 else 0, kt[0][-1]))
        for key, token in at_depth:
            index[key] = len(tokens)
            tokens.append(token)
            parents.append(depth - 1 if len(key) == 2 else index[key[:-1]])
    return tuple(int(t) for t in tokens), tuple(parents)
