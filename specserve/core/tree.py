"""A draft tree: proposed tokens arranged as a tree rooted at the committed prefix, with their q.

The data the tree rules of :mod:`specserve.core.tree_verification` read, and the
shapes the target's tree pass will use (docs/design.md, "Draft trees: exact
acceptance"). A chain is the special case ``parents = (-1, 0, 1, ...)``
(:meth:`DraftTree.from_chain`); :class:`~specserve.core.proposal.DraftProposal`
stays the chain's type.

Terms:

* **node** ``i`` (``0 <= i < nodes``): one proposed token ``tokens[i]``.
* **root**: the committed prefix, whose last position is pending: the target's
  pass at it gives ``p`` for the root's children. It is not a node; a node whose
  parent is the root has ``parents[i] = -1``.
* **depth**: 1 for the root's children, ``depth(parent) + 1`` below. With ``n``
  the index in the sequence of the first proposed token (the chain's
  ``position``), a node of depth ``d`` sits at index ``n + d - 1`` (its
  **tree position**, :meth:`DraftTree.position_ids`): siblings share a position.
* **siblings**: the children of one parent, in node order. That order is the
  order the draft drew them in and the order the verifier tries them in.
* ``q[i]``: the distribution the draft drew node ``i``'s token from, **without
  replacement** among its siblings: the ``r``-th sibling is a draw from
  ``q[i]`` with the tokens of the siblings before it removed and the rest
  renormalised (Sequoia's sampling without replacement). Siblings drawn from
  one distribution carry the same row. ``q = None``: each token is a point
  mass, a deterministic proposal (n-gram lookups, a greedy draft's top-k).

Checked on construction, each with an
:class:`~specserve.api.errors.InvalidArgument` that says what to fix: as many
parents as tokens; at most :data:`MAX_TREE_NODES` nodes and
:data:`MAX_TREE_DEPTH` levels; token ids ``>= 0`` (and ``< vocab`` when ``q``
is given; the verifiers check them against the target); every parent is ``-1``
or an earlier node (parents precede children, so there is no cycle); siblings
carry distinct tokens (every rule needs it: without replacement a repeat has
``q = 0``, and greedy and coupled acceptance pick *the* child that matches);
``q`` is ``[nodes, vocab]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.api.errors import InvalidArgument

#: Most nodes in one tree (a chain of ``max_gamma`` tokens, at most 64, fits).
MAX_TREE_NODES = 256
#: Most levels in one tree: the deepest chain a round may propose (``max_gamma`` is at most 64).
MAX_TREE_DEPTH = 64


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Proposed tokens as a tree (module docstring): ``tokens[i]`` whose parent is ``parents[i]``.

    ``q`` is ``[nodes, vocab]`` float (the verifiers take it as float64), row
    ``i`` the distribution node ``i`` was drawn from without replacement among
    its siblings; ``None`` means a point mass on each token.
    """

    tokens: tuple[int, ...]  # [nodes]
    parents: tuple[int, ...]  # [nodes]: -1 = the root, else an earlier node
    q: torch.Tensor | None = None  # [nodes, vocab]
    depths: tuple[int, ...] = field(init=False, repr=False)  # [nodes]: 1 for the root's children
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # [nodes + 1]: root's first

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(v) for v in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        nodes = len(tokens)
        if len(parents) != nodes:
            raise InvalidArgument(
                f"a draft tree needs one parent per token: {nodes} tokens, {len(parents)} parents"
            )
        if nodes > MAX_TREE_NODES:
            raise InvalidArgument(
                f"a draft tree has at most {MAX_TREE_NODES} nodes, got {nodes}: propose fewer"
            )
        if any(t < 0 for t in tokens):
            raise InvalidArgument(f"draft tree token ids must be >= 0, got {tokens}")
        children: list[list[int]] = [[] for _ in range(nodes + 1)]
        depths: list[int] = []
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise InvalidArgument(
                    f"node {i}'s parent must be -1 (the root) or an earlier node (parents precede children), "
                    f"got {parent}"
                )
            depth = 1 if parent < 0 else depths[parent] + 1
            if depth > MAX_TREE_DEPTH:
                raise InvalidArgument(
                    f"a draft tree has at most {MAX_TREE_DEPTH} levels: node {i} is at depth {depth}"
                )
            siblings = children[parent + 1]
            if any(tokens[s] == tokens[i] for s in siblings):
                raise InvalidArgument(
                    f"node {i} repeats token {tokens[i]} of an earlier sibling under parent {parent}: "
                    "siblings must carry distinct tokens"
                )
            siblings.append(i)
            depths.append(depth)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))
        if self.q is not None:
            if self.q.dim() != 2 or self.q.shape[0] != nodes or self.q.shape[1] < 1:
                raise InvalidArgument(f"q must be [nodes={nodes}, vocab], got {tuple(self.q.shape)}")
            if any(t >= self.q.shape[1] for t in tokens):
                raise InvalidArgument(f"draft tree token ids must be < the vocab size {self.q.shape[1]} of q")

    @classmethod
    def from_chain(cls, tokens: Sequence[int], qs: torch.Tensor | None = None) -> DraftTree:
        """The chain ``tokens[0] -> tokens[1] -> ...`` as a tree; ``qs`` ``[gamma, vocab]`` as a chain's q rows."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), qs)

    @property
    def nodes(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        """The number of levels: 0 for an empty tree, gamma for a chain."""
        return max(self.depths, default=0)

    def children(self, node: int) -> tuple[int, ...]:
        """The children of ``node`` (``-1`` = the root) in sibling order."""
        if not -1 <= node < self.nodes:
            raise InvalidArgument(f"node must be -1 (the root) or in [0, {self.nodes}), got {node}")
        return self._children[node + 1]

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to ``node`` (``()`` for the root)."""
        if not -1 <= node < self.nodes:
            raise InvalidArgument(f"node must be -1 (the root) or in [0, {self.nodes}), got {node}")
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return tuple(reversed(out))

    def position_ids(self, first_position: int) -> torch.Tensor:
        """The tree positions ``[nodes]`` int64: ``first_position + depth - 1`` (siblings share one).

        ``first_position``: the index in the sequence of the depth-1 tokens (the
        committed length). The target's pass places each node's token there.
        """
        depths = torch.tensor(self.depths, dtype=torch.int64).reshape(self.nodes)  # [nodes]
        return first_position - 1 + depths  # [nodes]

    def ancestor_mask(self) -> torch.Tensor:
        """``[nodes, nodes]`` bool: ``mask[i, j]`` iff node ``j`` is node ``i`` or one of its ancestors.

        The tree attention mask among the nodes: a node attends to its path and
        to nothing else of the tree (all nodes attend to the committed prefix,
        which is outside this mask). On a chain it is lower triangular.
        """
        mask = torch.zeros((self.nodes, self.nodes), dtype=torch.bool)  # [nodes, nodes]
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask
