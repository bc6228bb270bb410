"""specserve.core.ranked_tree: the tree a draft grows from its own ranking under a round's budget."""

from __future__ import annotations

import pytest

from specserve.api.errors import InvalidArgument
from specserve.core.ranked_tree import CHAIN, TreeBudget, grow_tree
from specserve.core.tree import DraftTree

pytestmark = pytest.mark.unit

#: A chain of three tokens with the draft's probabilities of them, and the runners-up at each depth.
CHAIN_TOKENS = (10, 11, 12)
CHAIN_PROBS = (0.5, 0.8, 0.6)
CANDIDATES = (
    ((20, 0.3), (21, 0.15), (22, 0.05)),  # depth 1: path probabilities 0.3, 0.15, 0.05
    ((30, 0.1), (31, 0.05)),  # depth 2: 0.5 * 0.1 = 0.05, 0.025
    ((40, 0.35), (41, 0.05)),  # depth 3: 0.5 * 0.8 * 0.35 = 0.14, 0.02
)


def _grow(max_nodes: int, threshold: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return grow_tree(CHAIN_TOKENS, CHAIN_PROBS, CANDIDATES, TreeBudget(max_nodes, threshold))


def test_the_best_alternatives_by_path_probability_hang_beside_the_chain():
    tokens, parents = _grow(6, 0.1)  # 0.3 (20), 0.15 (21), 0.14 (40) pass; room for 3
    assert tokens == (10, 11, 12, 20, 21, 40)
    assert parents == (-1, 0, 1, -1, -1, 1)  # 20 and 21 beside 10 (after it), 40 beside 12, below 11
    tree = DraftTree(tokens, parents)  # a valid tree: distinct siblings, parents first
    assert tree.max_depth == 3 and tree.children(-1) == (0, 3, 4)


def test_the_node_budget_keeps_the_best_first():
    assert _grow(5, 0.0) == ((10, 11, 12, 20, 21), (-1, 0, 1, -1, -1))  # 0.3 and 0.15, not 0.14
    assert _grow(4, 0.0) == ((10, 11, 12, 20), (-1, 0, 1, -1))
    everything, parents = _grow(256, 0.0)
    assert len(everything) == 3 + 7 and DraftTree(everything, parents).nodes == 10


def test_the_threshold_cuts_by_path_probability_not_by_the_nodes_own():
    # 40 has 0.35 at its node, above 30's 0.1, but its path (0.14) is below 0.15.
    assert _grow(8, 0.15) == ((10, 11, 12, 20, 21), (-1, 0, 1, -1, -1))
    assert _grow(8, 0.31) == (CHAIN_TOKENS, ())


@pytest.mark.parametrize(
    "budget",
    [TreeBudget(8, 1.0), TreeBudget(3, 0.0), TreeBudget(2, 0.0), TreeBudget(0, 0.0), CHAIN],
    ids=["threshold-1", "budget-of-the-chain", "budget-below-the-chain", "no-budget", "CHAIN"],
)
def test_a_threshold_of_1_or_no_room_gives_the_chain(budget):
    assert not budget.branches or budget.max_nodes <= len(CHAIN_TOKENS)
    assert grow_tree(CHAIN_TOKENS, CHAIN_PROBS, CANDIDATES, budget) == (CHAIN_TOKENS, ())


def test_a_chain_cut_short_has_candidates_for_its_depths_only():
    tokens, parents = grow_tree((10,), (0.5,), CANDIDATES[:1], TreeBudget(3, 0.1))
    assert (tokens, parents) == ((10, 20, 21), (-1, -1, -1))
    with pytest.raises(ValueError):
        grow_tree((10,), (0.5,), CANDIDATES, TreeBudget(3, 0.1))


@pytest.mark.parametrize(
    ("max_nodes", "threshold"), [(-1, 0.5), (257, 0.5), (4, -0.1), (4, 1.5), (4, float("nan"))]
)
def test_a_budget_out_of_range_is_refused(max_nodes, threshold):
    with pytest.raises(InvalidArgument):
        TreeBudget(max_nodes, threshold)
