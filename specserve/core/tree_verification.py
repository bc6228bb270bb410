"""Exact acceptance for draft trees: recursive rejection sampling without replacement, greedy, coupled.

Miao et al., "SpecInfer: Accelerating Large Language Model Serving with
Tree-based Speculative Inference and Verification", ASPLOS 2024
(arXiv:2305.09781), and Chen et al., "Sequoia: Scalable, Robust, and
Hardware-aware Speculative Decoding", 2024 (arXiv:2402.12374), for
:func:`verify_tree`; Daliri, Musco and Suresh, "Coupling without Communication
and Drafter-Invariant Speculative Decoding" (arXiv:2408.07978) and Rowan, Phan
and Khisti, "List-Level Distribution Coupling with Applications to Speculative
Decoding and Lossy Compression" (arXiv:2506.05632), for
:func:`verify_tree_coupled`. The chain rules are
:mod:`specserve.core.verification`, whose terms these extend; on a chain
(:meth:`~specserve.core.tree.DraftTree.from_chain`) each rule here returns
exactly the chain rule's verdict for the same inputs and seed. Why each rule
is exact: docs/design.md, "Draft trees: exact acceptance".

Terms, for one session and one round (the tree's own in :mod:`specserve.core.tree`):

* ``n`` (``position``): the index in the sequence of the depth-1 tokens, the
  chain's ``positions[b]``. The children of a node of depth ``d`` (the root:
  ``d = 0``) sit at index ``n + d``.
* ``p_v`` (target): the target's processed distribution after node ``v``:
  row 0 of ``target_probs`` ``[nodes + 1, vocab]`` is ``p`` at the root (after
  the committed prefix), row ``i + 1`` is ``p`` after node ``i`` (given the
  prefix and the path to ``i``). On a chain these are the chain's rows.
* ``q'_r`` (draft): the law of the ``r``-th sibling ``c_r`` (0-based) given the
  siblings before it: ``q[c_r]`` as shipped for ``r = 0``, and for ``r >= 1``
  ``q[c_r]`` with the tokens of ``c_0 .. c_{r-1}`` set to 0, renormalised
  (drawing without replacement). ``q = None``: ``q'_r`` is a point mass on
  ``c_r``'s token.
* **accepted path**: the nodes ``v_1, v_2, ...`` (depths 1, 2, ...) a rule
  walks down from the root; their tokens are emitted in order.
* **correction**: at a node whose children are all rejected, one token from
  the rule's final distribution there; the round ends.
* **bonus**: when the walk reaches a leaf (or the tree is empty), one token
  from ``p`` after it. Either way exactly one token follows the path.

**Recursive rejection sampling without replacement** (:func:`verify_tree`,
the ``optimal`` mode): at the current node ``v`` of depth ``d``, set
``p' = p_v`` and try its children in sibling order. Child ``c_r`` with token
``x`` is accepted iff ``u < p'(x) / q'_r(x)``,
``u = ranked_uniform(seed, n + d, ACCEPT, r)``; the walk moves to ``c_r``. On a
rejection ``p' <- norm(max(0, p' - q'_r))`` (the residual of
:func:`~specserve.core.verification.residual_distribution`) and the next
sibling is tried against the new ``p'`` and its own ``q'_{r+1}``, which no
longer holds ``x``. When every child is rejected the correction is sampled
from the last ``p'``; at a leaf the bonus is sampled from ``p_v``; either with
``uniform(seed, n + d, RESAMPLE)``. Rank 0 is the chain's key, so a chain draws
what the chain rule draws; only one node per depth is ever visited, so no key
is drawn twice. Every number is drawn only when needed.

**Greedy** (:func:`verify_tree_greedy`): the target's argmax after each node;
at each node the child whose token is the argmax is accepted. The target's
argmax takes the lowest id on ties
(:func:`~specserve.core.sampling.greedy_tokens`); siblings are distinct, so at
most one child matches, and the walk is the longest path whose every token is
the target's argmax after its parent. The argmax after the path is emitted.

**Coupled** (:func:`verify_tree_coupled`, the ``coupled`` mode): the target's
token at depth ``d + 1`` below a node of depth ``d`` is
``y = argmax(log p_v + G)``, ``G = gumbel_noise(seed, n + d)``, the noise the
chain's :func:`~specserve.core.verification.verify_coupled` uses at that index.
The child whose token is ``y`` is accepted; when none is, ``y`` is the
correction, and at a leaf the bonus. The emitted tokens are always
``y_1, y_2, ...``: target-only Gumbel-max sampling with the seed's noise,
whatever the tree's shape, its tokens or its q (which is not read). A draft
makes ``y`` likely to be among the children by proposing several candidates
coupled to the same noise (Gumbel-max list sampling).

Impossible branches raise, as the chain rules do: a node whose ``q'`` gives its
token probability 0 (:class:`~specserve.api.errors.ZeroDraftProbability`); a
NaN / negative / unnormalised row of ``p`` or ``q``
(:class:`~specserve.api.errors.InvalidDistribution`, tolerance ``1e-3`` on the
sum); a rejection where ``max(0, p' - q'_r)`` has no mass
(:class:`~specserve.api.errors.ZeroResidualMass`); bad shapes or ids
(:class:`~specserve.api.errors.InvalidArgument`,
:class:`~specserve.api.errors.VocabularyMismatch`).

Pure maths, as :mod:`specserve.core.verification`: no gRPC, Redis or logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.api.errors import InvalidArgument, VocabularyMismatch, ZeroDraftProbability
from specserve.core.rng import Purpose, gumbel_noise, ranked_uniform
from specserve.core.sampling import gumbel_argmax, sample_rows
from specserve.core.tree import DraftTree
from specserve.core.verification import (
    VerifyOutcome,
    _require_distributions,
    acceptance_probs,
    residual_distribution,
)


@dataclass(frozen=True)
class TreeOutcome:
    """One tree's verdict: the accepted ``path`` (node indices, depth 1 first) and the ``emitted`` tokens.

    ``emitted`` is the path's tokens, then the correction or the bonus;
    ``bonus`` is True when the path ends at a leaf (also for an empty tree).
    """

    path: tuple[int, ...]  # [accepted]
    emitted: tuple[int, ...]  # [accepted + 1]
    bonus: bool

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def next_token(self) -> int:
        """The correction (after the children of the path's end were rejected) or the bonus."""
        return self.emitted[-1]

    def as_verify_outcome(self) -> VerifyOutcome:
        """The chain rule's verdict type: on a chain the path is a prefix, so ``accepted`` says it all."""
        return VerifyOutcome(accepted=self.accepted, next_token=self.next_token, bonus=self.bonus)


def verify_tree(target_probs: torch.Tensor, tree: DraftTree, seed: int, position: int) -> TreeOutcome:
    """Recursive rejection sampling without replacement over each node's children (module docstring).

    ``target_probs``: ``[nodes + 1, vocab]``, row 0 at the root, row ``i + 1``
    after node ``i``. ``seed``: the session seed; ``position``: the index in the
    sequence of the depth-1 tokens.
    """
    p = _check_target(target_probs, tree, position)  # [nodes + 1, vocab] float64
    q = _check_draft(tree, p.device)  # [nodes, vocab] float64, or None for point masses
    node = -1
    path: list[int] = []
    while True:
        kids = tree.children(node)
        index = position + len(path)  # the children's index in the sequence
        row = p[node + 1 : node + 2]  # [1, vocab]: p after the path's end
        chosen, residual = _try_children(row, kids, tree, q, seed, index)  # residual: [1, vocab]
        if chosen is None:
            next_token = sample_rows(residual, [ranked_uniform(seed, index, Purpose.RESAMPLE, 0)])[0]
            return _outcome(tree, path, next_token, bonus=not kids)
        node = chosen
        path.append(node)


def _try_children(
    p_row: torch.Tensor,
    kids: Sequence[int],
    tree: DraftTree,
    q: torch.Tensor | None,
    seed: int,
    index: int,
) -> tuple[int | None, torch.Tensor]:
    """Try ``kids`` in order against ``p_row`` ``[1, vocab]``: the accepted child, or None and the last ``p'``.

    ``p'`` is ``[1, vocab]``; ``index`` is the children's index in the sequence. The ``r``-th test draws
    ``ranked_uniform(seed, index, ACCEPT, r)``. With no children ``p'`` is
    ``p_row`` itself (the bonus's distribution).
    """
    residual = p_row  # [1, vocab]: p'
    for rank, child in enumerate(kids):
        token = tree.tokens[child]
        q_child = _sibling_q(q, tree, kids[:rank], child, p_row)  # [1, vocab]: q'_r
        ratio = float(acceptance_probs(residual[0, token], q_child[0, token]))
        if ranked_uniform(seed, index, Purpose.ACCEPT, rank) < ratio:
            return child, residual
        residual = residual_distribution(residual, q_child)  # [1, vocab]
    return None, residual


def _sibling_q(
    q: torch.Tensor | None, tree: DraftTree, earlier: Sequence[int], child: int, p_row: torch.Tensor
) -> torch.Tensor:
    """``q'_r`` of ``child`` given its ``earlier`` siblings: ``[1, vocab]`` float64 (module docstring).

    The first sibling's row is used as shipped (bit for bit the chain's); a
    later one's has the earlier tokens removed and is renormalised. ``q`` is
    None: a point mass on the child's token (shaped as ``p_row`` ``[1, vocab]``).
    """
    if q is None:
        point = torch.zeros_like(p_row)  # [1, vocab]
        point[0, tree.tokens[child]] = 1.0  # as the chain's one-hot q of a point mass
        return point
    row = q[child : child + 1]  # [1, vocab]
    if not earlier:
        return row
    row = row.clone()
    row[0, [tree.tokens[s] for s in earlier]] = 0.0
    mass = row.sum(dim=-1, keepdim=True)  # [1, 1]; > 0: the child's own entry is > 0 (_check_draft)
    return row / mass


def verify_tree_greedy(target_argmax: torch.Tensor, tree: DraftTree) -> TreeOutcome:
    """Greedy acceptance: the longest path matching the target's argmax, then the argmax after it.

    ``target_argmax``: ``[nodes + 1]`` int64, entry 0 the argmax at the root,
    entry ``i + 1`` after node ``i``. Needs no randomness.
    """
    if target_argmax.dim() != 1 or target_argmax.shape[0] != tree.nodes + 1:
        raise InvalidArgument(
            f"target_argmax must be [nodes + 1 = {tree.nodes + 1}], got {tuple(target_argmax.shape)}"
        )
    return _walk_matching(tree, [int(t) for t in target_argmax.tolist()])


def verify_tree_coupled(target_probs: torch.Tensor, tree: DraftTree, seed: int, position: int) -> TreeOutcome:
    """The coupled rule on a tree (module docstring): accept the child equal to ``argmax(log p_v + G)``.

    Arguments as :func:`verify_tree`; the tree's q, if any, is not read.
    Draws the noise of indices ``position .. position + max_depth`` (one row per
    depth, shared by siblings), on ``target_probs``' device.
    """
    p = _check_target(target_probs, tree, position)  # [nodes + 1, vocab] float64
    levels = tree.max_depth + 1
    noise = gumbel_noise([seed] * levels, [position + d for d in range(levels)], p.shape[-1], device=p.device)
    row_depth = torch.tensor((0, *tree.depths), dtype=torch.int64, device=p.device)  # [nodes + 1]
    winners = gumbel_argmax(p, noise[row_depth])  # [nodes + 1]: the target's token after each row
    return _walk_matching(tree, [int(t) for t in winners.tolist()])


def _walk_matching(tree: DraftTree, target_tokens: Sequence[int]) -> TreeOutcome:
    """From the root, accept the child whose token is ``target_tokens[row]``; emit the first unmatched one.

    ``target_tokens``: ``[nodes + 1]``, the target's token after the root (0) and after each node.
    """
    node = -1
    path: list[int] = []
    while True:
        want = target_tokens[node + 1]
        kids = tree.children(node)
        match = next((c for c in kids if tree.tokens[c] == want), None)
        if match is None:
            return _outcome(tree, path, want, bonus=not kids)
        node = match
        path.append(node)


def _outcome(tree: DraftTree, path: Sequence[int], next_token: int, *, bonus: bool) -> TreeOutcome:
    return TreeOutcome(
        path=tuple(path), emitted=(*(tree.tokens[v] for v in path), int(next_token)), bonus=bonus
    )


def _check_target(target_probs: torch.Tensor, tree: DraftTree, position: int) -> torch.Tensor:
    """Shapes, ids and the target rows: ``[nodes + 1, vocab]`` float64, used as given."""
    if target_probs.dim() != 2 or target_probs.shape[0] != tree.nodes + 1:
        raise InvalidArgument(
            f"target_probs must be [nodes + 1 = {tree.nodes + 1}, vocab], got {tuple(target_probs.shape)}"
        )
    if position < 0:
        raise InvalidArgument(f"position must be >= 0, got {position}")
    vocab_size = target_probs.shape[1]
    if any(t >= vocab_size for t in tree.tokens):
        raise InvalidArgument(f"draft tree token ids must be < the target's vocab size {vocab_size}")
    if tree.q is not None and tree.q.shape[-1] != vocab_size:
        raise VocabularyMismatch(f"draft distributions have {tree.q.shape[-1]} entries, target {vocab_size}")
    p = target_probs.to(torch.float64)  # [nodes + 1, vocab]
    _require_distributions(p, None, "target")
    return p


def _check_draft(tree: DraftTree, device: torch.device) -> torch.Tensor | None:
    """The tree's q rows, checked: ``[nodes, vocab]`` float64 or None; every node's own token has q > 0.

    Checks every node, reached or not, as the chain rule checks every proposed
    token. A later sibling's ``q'`` then has mass: its own token is not removed.
    """
    if tree.q is None or tree.nodes == 0:
        return None
    q = tree.q.to(device=device, dtype=torch.float64)  # [nodes, vocab]
    _require_distributions(q, None, "draft")
    own = q[torch.arange(tree.nodes, device=device), torch.tensor(tree.tokens, device=device)]  # [nodes]
    zero = torch.nonzero(own <= 0).reshape(-1)
    if zero.numel():
        i = int(zero[0])
        raise ZeroDraftProbability(f"node {i}'s token {tree.tokens[i]} has draft probability 0")
    return q
