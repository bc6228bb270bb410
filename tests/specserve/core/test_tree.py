"""DraftTree: the helpers (depths, children, paths, tree positions, the ancestor mask, from_chain) on
worked trees and on random trees against brute force, and every malformed tree refused with a message
that names what to fix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.api.errors import InvalidArgument
from specserve.core.tree import MAX_TREE_DEPTH, MAX_TREE_NODES, DraftTree

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.unit]

F64 = torch.float64

#   root ─┬─ 0 (tok 5) ─┬─ 2 (tok 1) ── 4 (tok 2)
#         │             └─ 3 (tok 2)
#         └─ 1 (tok 7) ──── 5 (tok 5)
WORKED = DraftTree(tokens=(5, 7, 1, 2, 2, 5), parents=(-1, -1, 0, 0, 2, 1))


def test_worked_tree_helpers():
    tree = WORKED
    assert tree.nodes == 6 and tree.max_depth == 3
    assert tree.depths == (1, 1, 2, 2, 3, 2)
    assert tree.children(-1) == (0, 1)
    assert tree.children(0) == (2, 3)
    assert tree.children(2) == (4,)
    assert tree.children(4) == () and tree.children(3) == ()
    assert tree.path(-1) == ()
    assert tree.path(4) == (0, 2, 4)
    assert tree.path(5) == (1, 5)
    assert tree.position_ids(10).tolist() == [10, 10, 11, 11, 12, 11]
    assert tree.position_ids(10).dtype == torch.int64
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [0, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask(), expected)


def test_the_same_token_under_different_parents_is_allowed():
    """Tokens 5 and 2 appear twice in WORKED, never twice under one parent."""
    assert sorted(WORKED.tokens) == [1, 2, 2, 5, 5, 7]


def test_from_chain():
    q = torch.softmax(torch.randn(4, 9, dtype=F64), -1)
    tree = DraftTree.from_chain([3, 1, 4, 1], q)
    assert tree.parents == (-1, 0, 1, 2)
    assert tree.depths == (1, 2, 3, 4) and tree.max_depth == 4
    assert tree.q is q
    assert tree.path(3) == (0, 1, 2, 3)
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.position_ids(7).tolist() == [7, 8, 9, 10]  # a chain's positions


def test_the_empty_tree():
    tree = DraftTree((), ())
    assert tree.nodes == 0 and tree.max_depth == 0
    assert tree.children(-1) == ()
    assert tree.ancestor_mask().shape == (0, 0)
    assert tree.position_ids(3).shape == (0,)
    assert DraftTree.from_chain([]).nodes == 0


@st.composite
def trees(draw) -> DraftTree:
    nodes = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(nodes)]
    tokens: list[int] = []
    for i, parent in enumerate(parents):  # distinct among siblings
        taken = {tokens[j] for j in range(i) if parents[j] == parent}
        tokens.append(draw(st.integers(0, 20).filter(lambda t, taken=taken: t not in taken)))
    return DraftTree(tuple(tokens), tuple(parents))


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 1000))
def test_helpers_agree_with_brute_force(tree, first):
    """Paths by walking parents; depth = path length; the mask holds exactly the path; children invert
    parents, in node order; positions are first + depth - 1."""
    mask = tree.ancestor_mask()
    for i in range(tree.nodes):
        walk, v = [], i
        while v != -1:
            walk.append(v)
            v = tree.parents[v]
        assert tree.path(i) == tuple(reversed(walk))
        assert tree.depths[i] == len(walk)
        assert set(torch.nonzero(mask[i]).reshape(-1).tolist()) == set(walk)
        assert int(tree.position_ids(first)[i]) == first + len(walk) - 1
    for v in range(-1, tree.nodes):
        assert tree.children(v) == tuple(i for i in range(tree.nodes) if tree.parents[i] == v)
    assert tree.max_depth == max(tree.depths, default=0)


# --------------------------------------------------------------------------- malformed trees

MALFORMED = {
    "more tokens than parents": (lambda: DraftTree((1, 2), (-1,)), "one parent per token"),
    "a parent after its child": (lambda: DraftTree((1, 2), (1, -1)), "parents precede children"),
    "a node its own parent (a cycle)": (lambda: DraftTree((1,), (0,)), "parents precede children"),
    "a two-node cycle": (lambda: DraftTree((1, 2, 3), (-1, 2, 1)), "parents precede children"),
    "a parent below -1": (lambda: DraftTree((1,), (-2,)), "parents precede children"),
    "a negative token": (lambda: DraftTree((-1,), (-1,)), ">= 0"),
    "repeated siblings under the root": (lambda: DraftTree((4, 4), (-1, -1)), "distinct tokens"),
    "repeated siblings deeper": (lambda: DraftTree((1, 2, 3, 2), (-1, 0, 0, 0)), "distinct tokens"),
    "too many nodes": (
        lambda: DraftTree(tuple(range(MAX_TREE_NODES + 1)), (-1,) * (MAX_TREE_NODES + 1)),
        f"at most {MAX_TREE_NODES} nodes",
    ),
    "too deep": (
        lambda: DraftTree.from_chain([0] * (MAX_TREE_DEPTH + 1)),
        f"at most {MAX_TREE_DEPTH} levels",
    ),
    "q with too few rows": (lambda: DraftTree((1, 2), (-1, 0), torch.full((1, 3), 1 / 3)), "q must be"),
    "q not a matrix": (lambda: DraftTree((1,), (-1,), torch.full((3,), 1 / 3)), "q must be"),
    "a token outside q's vocabulary": (
        lambda: DraftTree((3,), (-1,), torch.full((1, 3), 1 / 3)),
        "< the vocab",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_trees_are_refused_saying_what_to_fix(name):
    build, fragment = MALFORMED[name]
    with pytest.raises(InvalidArgument) as info:
        build()
    assert info.type is InvalidArgument and fragment in str(info.value), str(info.value)


def test_the_limits_themselves_are_allowed():
    assert DraftTree(tuple(range(MAX_TREE_NODES)), (-1,) * MAX_TREE_NODES).nodes == MAX_TREE_NODES
    assert DraftTree.from_chain([0] * MAX_TREE_DEPTH).max_depth == MAX_TREE_DEPTH


def test_helpers_refuse_nodes_outside_the_tree():
    for bad in (-2, WORKED.nodes):
        with pytest.raises(InvalidArgument):
            WORKED.children(bad)
        with pytest.raises(InvalidArgument):
            WORKED.path(bad)
