"""Exact acceptance for draft trees: exact enumeration, statistics against biased verifiers, coupled
invariance across tree shapes, greedy, chain equivalence, impossible branches.

The toy language model is the Markov chain of ``test_verification.py``: the target's next-token
distribution after token ``t`` is ``P[t]``, the draft's ``Q[t]``. A tree's target rows are
``P[c0], P[tokens[0]], ..., P[tokens[nodes - 1]]`` (``c0`` the last committed token): exactly what a
real target computes after each node, since the Markov target looks at the last token only.

**The exact model** (:func:`routes`): an independent numpy rendering of the rule of
``specserve.core.tree_verification`` that lists every route through it (every accept / reject decision
and the final token) with its exact probability and a uniform inside each decision's interval. The
drafted trees are enumerated too (:func:`draw_trees`: every ordered draw of the siblings without
replacement, with its probability). Each route is scripted into the real ``verify_tree``
(:class:`ScriptedUniforms`, a fake of ``ranked_uniform`` that fails the test on a key the route does
not list or on a key drawn twice), which must reach exactly the route's outcome; the emitted blocks,
completed by target-only sampling to ``max_depth + 1`` tokens and weighted by their probabilities, give
the target's law to 1e-9 (so the first token's law, the first two tokens' and every longer prefix's).
The same model with a deliberate bias misses the target's law by more than 1e-2.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import specserve.core.tree_verification as tree_verification
from specserve.api.errors import (
    InvalidArgument,
    InvalidDistribution,
    VocabularyMismatch,
    ZeroDraftProbability,
    ZeroResidualMass,
)
from specserve.api.params import SamplingParams
from specserve.core.proposal import DraftProposal
from specserve.core.rng import Purpose, gumbel_noise, ranked_uniform
from specserve.core.sampling import logits_to_probs, sample_rows
from specserve.core.tree import DraftTree
from specserve.core.tree_verification import (
    TreeOutcome,
    verify_tree,
    verify_tree_coupled,
    verify_tree_greedy,
)
from specserve.core.verification import verify_batch, verify_coupled, verify_greedy

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.unit]

F64 = torch.float64
N0 = 7  # sequence index of the depth-1 tokens

Key = tuple[int, Purpose, int]  # (position, purpose, rank)


class ScriptedUniforms:
    """A fake of :func:`specserve.core.rng.ranked_uniform` (named as such): ``(seed, position, purpose, rank) -> u``.

    A key that is not in the table fails the test (a verifier that draws a number its route does not
    need: a wrong position, purpose or rank, a test after an acceptance); so does a key drawn twice
    in one call. :meth:`drawn_exactly` says whether a call drew every key of its route.
    """

    def __init__(self) -> None:
        self.table: dict[tuple[int, int, Purpose, int], float] = {}
        self.drawn: list[tuple[int, int, Purpose, int]] = []

    def load(self, seed: int, draws: dict[Key, float]) -> None:
        self.drawn.clear()
        for (position, purpose, rank), u in draws.items():
            self.table[(seed, position, Purpose(purpose), rank)] = u

    def __call__(self, seed: int, position: int, purpose: Purpose, rank: int) -> float:
        key = (seed, position, Purpose(purpose), rank)
        if key not in self.table:
            raise AssertionError(f"the verifier drew a uniform it should not need: {key}")
        if key in self.drawn:
            raise AssertionError(f"the verifier drew {key} twice")
        self.drawn.append(key)
        return self.table[key]

    def drawn_exactly(self, seed: int, draws: dict[Key, float]) -> bool:
        return sorted(self.drawn) == sorted((seed, pos, Purpose(purpose), r) for pos, purpose, r in draws)


@pytest.fixture
def scripted(monkeypatch) -> ScriptedUniforms:
    fake = ScriptedUniforms()
    monkeypatch.setattr(tree_verification, "ranked_uniform", fake)
    return fake


# --------------------------------------------------------------------------- the exact model

#: A tree's shape: the tuple of its root's children's shapes (``()`` is a leaf).
Shape = tuple


@dataclass(frozen=True, eq=False)
class Drawn:
    """One drafted tree and the probability the draft drew it."""

    tree: DraftTree
    prob: float


def draw_trees(Q: np.ndarray, c0: int, shape: Shape) -> list[Drawn]:
    """Every tree of ``shape`` the draft can draw after ``c0``, with its probability.

    Each node's children are drawn in order **without replacement** from ``Q[its token]``: the
    ``r``-th with probability ``Q[c, t_r] / (1 - sum_{j < r} Q[c, t_j])``. Nodes are numbered in
    preorder (so siblings are in drawing order and parents precede children); every node carries its
    parent's full row ``Q[c]``.
    """
    vocab = Q.shape[0]

    def subtrees(
        context: int, parent: int, shapes: Shape, next_id: int
    ) -> list[tuple[list, list, list, float, int]]:
        out = []
        for seq in itertools.permutations(range(vocab), len(shapes)):
            prob, used = 1.0, 0.0
            for t in seq:
                left = 1.0 - used
                prob *= Q[context, t] / left if left > 0 else 0.0
                used += Q[context, t]
            if prob <= 0:
                continue
            partial = [([], [], [], prob, next_id)]
            for t, sub in zip(seq, shapes, strict=True):
                partial = [
                    ([*toks, t, *st], [*pars, parent, *sp], [*qs, Q[context], *sq], pr * spr, nid2)
                    for toks, pars, qs, pr, nid in partial
                    for st, sp, sq, spr, nid2 in subtrees(t, nid, sub, nid + 1)
                ]
            out += partial
        return out

    drawn = []
    for tokens, parents, qs, prob, _ in subtrees(c0, -1, shape, 0):
        q = torch.tensor(np.array(qs).reshape(len(tokens), vocab), dtype=F64)
        drawn.append(Drawn(DraftTree(tuple(tokens), tuple(parents), q), prob))
    return drawn


@dataclass(frozen=True)
class Route:
    """One way through a tree: its probability, the verdict, and uniforms that lead there."""

    prob: float
    path: tuple[int, ...]
    emitted: tuple[int, ...]
    bonus: bool
    draws: dict[Key, float]


def routes(
    tree: DraftTree,
    p_rows: np.ndarray,
    *,
    correction_from_p: bool = False,
    without_replacement: bool = True,
) -> list[Route]:
    """Every route through recursive rejection sampling without replacement (module docstring).

    ``p_rows`` ``[nodes + 1, V]``. Biases for the power analyses: ``correction_from_p`` samples the
    correction from ``p_v`` instead of the final residual; ``without_replacement=False`` keeps every
    sibling's ``q`` whole (SpecInfer's with-replacement rule applied to draws made without replacement).
    """
    vocab = p_rows.shape[1]
    q = None if tree.q is None else tree.q.numpy()
    out: list[Route] = []

    def walk(node: int, prob: float, path: tuple[int, ...], draws: dict[Key, float]) -> None:
        index = N0 + len(path)
        kids = tree.children(node)
        residual = p_rows[node + 1].copy()
        for r, child in enumerate(kids):
            token = tree.tokens[child]
            if q is None:
                q_child = np.eye(vocab)[token]
            else:
                q_child = q[child].copy()
                if without_replacement and r:
                    q_child[[tree.tokens[s] for s in kids[:r]]] = 0.0
                    q_child /= q_child.sum()
            a = min(1.0, residual[token] / q_child[token])
            key = (index, Purpose.ACCEPT, r)
            if a > 0:
                walk(child, prob * a, (*path, child), {**draws, key: a / 2})
            if a >= 1:
                return
            draws = {**draws, key: (1 + a) / 2}
            prob *= 1 - a
            residual = np.maximum(residual - q_child, 0.0)
            residual /= residual.sum()
        final = p_rows[node + 1] if correction_from_p or not kids else residual
        cdf = np.cumsum(final)
        for y in range(vocab):
            if final[y] > 0:
                u = ((cdf[y - 1] if y else 0.0) + cdf[y]) / 2 / cdf[-1]
                emitted = (*(tree.tokens[v] for v in path), y)
                out.append(
                    Route(
                        prob * final[y], path, emitted, not kids, {**draws, (index, Purpose.RESAMPLE, 0): u}
                    )
                )

    walk(-1, 1.0, (), {})
    return out


def chain(P: np.ndarray, start: int, length: int) -> dict[tuple[int, ...], float]:
    """Target-only sampling: the probability of each continuation of ``length`` tokens after ``start``."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(P.shape[0]), repeat=length):
        prob, prev = 1.0, start
        for token in seq:
            prob *= float(P[prev, token])
            prev = token
        out[seq] = prob
    return out


def emitted_law(
    P: np.ndarray,
    c0: int,
    drawn: list[Drawn],
    length: int,
    scripted: ScriptedUniforms | None = None,
    **bias: bool,
) -> dict[tuple[int, ...], float]:
    """The law of the emitted block completed by target-only sampling to ``length`` tokens.

    With ``scripted``, every route is also driven through the real ``verify_tree``, which must reach
    the route's verdict drawing exactly the route's uniforms.
    """
    completed: dict[tuple[int, ...], float] = defaultdict(float)
    seed = 0
    for d in drawn:
        p_rows = P[[c0, *d.tree.tokens]]
        target = torch.tensor(p_rows, dtype=F64)  # [nodes + 1, V]
        for route in routes(d.tree, p_rows, **bias):
            if scripted is not None:
                scripted.load(seed, route.draws)
                outcome = verify_tree(target, d.tree, seed, N0)
                assert outcome == TreeOutcome(route.path, route.emitted, route.bonus), (d.tree, route)
                assert scripted.drawn_exactly(seed, route.draws), (scripted.drawn, route.draws)
                seed += 1
            for tail, prob in chain(P, route.emitted[-1], length - len(route.emitted)).items():
                completed[route.emitted + tail] += d.prob * route.prob * prob
    return completed


def worst_error(completed: dict[tuple[int, ...], float], P: np.ndarray, c0: int, length: int) -> float:
    expected = chain(P, c0, length)
    assert set(completed) <= set(expected), "emitted a sequence the target gives probability 0"
    return max(abs(completed.get(seq, 0.0) - prob) for seq, prob in expected.items())


def marginal(completed: dict[tuple[int, ...], float], k: int) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for seq, prob in completed.items():
        out[seq[:k]] += prob
    return out


def depth_of(shape: Shape) -> int:
    return 1 + max((depth_of(s) for s in shape), default=0) if shape else 0


def dirichlet(rng: np.random.Generator, vocab: int) -> np.ndarray:
    return rng.dirichlet(np.ones(vocab), size=vocab)  # [V, V], rows sum to 1


def zero_some(rng: np.random.Generator, M: np.ndarray, per_row: int) -> np.ndarray:
    M = M.copy()
    for row in M:
        row[rng.choice(len(row), per_row, replace=False)] = 0.0
    return M / M.sum(-1, keepdims=True)


def check_exact(scripted: ScriptedUniforms, P: np.ndarray, Q: np.ndarray, c0: int, shape: Shape) -> None:
    """The real verifier over every drafted tree of ``shape`` emits the target's law, to 1e-9; the same
    trees under either bias miss it by more than 1e-2 (when the shape lets the bias act)."""
    drawn = draw_trees(Q, c0, shape)
    assert abs(sum(d.prob for d in drawn) - 1.0) < 1e-12  # the enumeration of the draft is complete
    length = depth_of(shape) + 1
    law = emitted_law(P, c0, drawn, length, scripted)
    assert worst_error(law, P, c0, length) <= 1e-9
    for k in (1, 2):  # the first token, and the first two jointly, as the issue asks (implied above)
        for prefix, prob in chain(P, c0, k).items():
            assert abs(marginal(law, k)[prefix] - prob) <= 1e-9


# --------------------------------------------------------------------------- the worked example, grown

P_WORKED = np.array([0.5, 0.3, 0.2])
Q_WORKED = np.array([0.6, 0.1, 0.3])


def test_worked_example_as_a_tree_of_two_children(scripted):
    """p = [0.5, 0.3, 0.2], q = [0.6, 0.1, 0.3] (the issue's example), two children drawn without
    replacement. Children (0, 2): 0 is accepted with probability 5/6; after its rejection
    p' = norm(max(0, p - q)) = [0, 1, 0] and q' = q without 0 = [0, 0.25, 0.75], so 2 is surely rejected
    and the correction is 1. Over all six ordered draws the first token is distributed as p exactly."""
    P = np.stack([P_WORKED] * 3)
    Q = np.stack([Q_WORKED] * 3)
    tree = DraftTree((0, 2), (-1, -1), torch.tensor(np.stack([Q_WORKED] * 2), dtype=F64))
    by_route = {(r.path, r.emitted): r.prob for r in routes(tree, P[[0, 0, 2]])}
    assert by_route == pytest.approx(
        {
            ((0,), (0, 0)): 5 / 6 * 0.5,
            ((0,), (0, 1)): 5 / 6 * 0.3,
            ((0,), (0, 2)): 5 / 6 * 0.2,
            ((), (1,)): 1 / 6,
        }
    )
    check_exact(scripted, P, Q, 0, ((), ()))


def test_worked_example_with_every_token_a_child(scripted):
    """Three children (the whole vocabulary, in every order): still exactly p, and some child is always
    accepted: a rejected token leaves p' with no mass on it, so the last child's residual p' is the
    point mass of the one token left, which is that child's q' too."""
    P, Q = np.stack([P_WORKED] * 3), np.stack([Q_WORKED] * 3)
    drawn = draw_trees(Q, 0, ((), (), ()))
    assert len(drawn) == 6
    assert all(len(r.path) == 1 for d in drawn for r in routes(d.tree, P[[0, *d.tree.tokens]]))
    check_exact(scripted, P, Q, 0, ((), (), ()))


# Row 0 is the worked example; the other rows make a Markov chain (test_verification.py's P_STAT, Q_STAT).
P_MARKOV = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])
Q_MARKOV = np.array([[0.6, 0.1, 0.3], [0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])

SHAPES = {
    "2 children": ((), ()),
    "2x2, depth 2": (((), ()), ((), ())),
    "3 children with one child each": (((),), ((),), ((),)),
    "irregular, depth 3": ((((),), ()), ()),
    "chain of 3": ((((),),),),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_worked_example_grown_into_trees(scripted, shape):
    check_exact(scripted, P_MARKOV, Q_MARKOV, 0, SHAPES[shape])


# --------------------------------------------------------------------------- exact, random P and Q


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["2x2, depth 2", "irregular, depth 3"])
def test_exact_distribution_random(scripted, shape, seed):
    """Random P and Q on 3 tokens (Dirichlet): the real verifier's law is the target's to 1e-9."""
    rng = np.random.default_rng(1000 + seed)
    P, Q = dirichlet(rng, 3), dirichlet(rng, 3)
    check_exact(scripted, P, Q, seed % 3, SHAPES[shape])


def test_exact_distribution_on_four_tokens(scripted):
    """Four tokens, a root with three children, the first of which has two (and tokens removed from P)."""
    rng = np.random.default_rng(7)
    P, Q = zero_some(rng, dirichlet(rng, 4), 1), dirichlet(rng, 4)
    check_exact(scripted, P, Q, 2, (((), ()), (), ()))


def test_exact_distribution_truncated_draft(scripted):
    """A top-2 draft (Q has 1 zero per row of 3): the second sibling's q' is a point mass."""
    rng = np.random.default_rng(8)
    P, Q = dirichlet(rng, 3), zero_some(rng, dirichlet(rng, 3), 1)
    check_exact(scripted, P, Q, 1, (((), ()), ((), ())))


def test_exact_distribution_disjoint_supports(scripted):
    """P on {0, 1}, Q on {2, 3}: every child is rejected and the correction is p itself."""
    P = np.array([[0.7, 0.3, 0, 0], [0.4, 0.6, 0, 0], [0.5, 0.5, 0, 0], [0.1, 0.9, 0, 0]])
    Q = np.array([[0, 0, 0.2, 0.8], [0, 0, 0.5, 0.5], [0, 0, 0.6, 0.4], [0, 0, 0.3, 0.7]])
    for d in draw_trees(Q, 3, ((), ())):
        assert {r.path for r in routes(d.tree, P[[3, *d.tree.tokens]])} == {()}
    check_exact(scripted, P, Q, 3, ((), ()))


def test_exact_distribution_identical_draft(scripted):
    """Q == P: the first child is always accepted and later siblings are never tried."""
    rng = np.random.default_rng(9)
    P = zero_some(rng, dirichlet(rng, 3), 1)
    for d in draw_trees(P, 0, (((), ()), ((), ()))):
        assert all(r.path[:1] == (0,) for r in routes(d.tree, P[[0, *d.tree.tokens]]))
    check_exact(scripted, P, P.copy(), 0, (((), ()), ((), ())))


def test_exact_distribution_point_mass_candidates(scripted):
    """A deterministic proposer (q = None) offering its two favourite continuations at each node, as an
    n-gram lookup with two matches would: exact too (each candidate's law is a point mass)."""
    rng = np.random.default_rng(10)
    P = zero_some(rng, dirichlet(rng, 4), 1)
    favourites = {0: (1, 2), 1: (3, 0), 2: (2, 1), 3: (0, 3)}
    for c0 in range(4):
        a, b = favourites[c0]
        tokens = (a, *favourites[a], b, *favourites[b])
        tree = DraftTree(tokens, (-1, 0, 0, -1, 3, 3))
        law = emitted_law(P, c0, [Drawn(tree, 1.0)], 3, scripted)
        assert worst_error(law, P, c0, 3) <= 1e-9


def test_the_biases_miss_the_target_on_the_same_enumeration(scripted):
    """The enumeration is not vacuous: on four tokens and three children, sampling the correction from p
    (instead of the residual) or keeping each sibling's q whole (SpecInfer's with-replacement rule on
    draws made without replacement) each miss the target's law by more than 1e-2; the real rule, driven
    through the real verifier, is exact. (Keeping q whole is harmless where every residual entry is at
    least the sibling's q', as on the 3-token examples above; these P and Q were chosen where it is not.)"""
    rng = np.random.default_rng(2)
    P, Q = dirichlet(rng, 4), dirichlet(rng, 4)
    drawn = draw_trees(Q, 0, ((), (), ()))
    assert worst_error(emitted_law(P, 0, drawn, 2, scripted), P, 0, 2) <= 1e-9
    for bias in ({"correction_from_p": True}, {"without_replacement": False}):
        assert worst_error(emitted_law(P, 0, drawn, 2, **bias), P, 0, 2) > 1e-2, bias


def test_a_sure_rejection_at_the_boundary(scripted):
    """u exactly at the acceptance ratio rejects (the test is u < ratio), as the chain rule's."""
    tree = DraftTree((0,), (-1,), torch.tensor(Q_WORKED[None], dtype=F64))
    target = torch.tensor(np.stack([P_WORKED, P_WORKED]), dtype=F64)
    ratio = 0.5 / 0.6
    scripted.load(1, {(N0, Purpose.ACCEPT, 0): ratio, (N0, Purpose.RESAMPLE, 0): 0.0})
    assert verify_tree(target, tree, 1, N0) == TreeOutcome((), (1,), False)
    scripted.load(
        2, {(N0, Purpose.ACCEPT, 0): math.nextafter(ratio, 0.0), (N0 + 1, Purpose.RESAMPLE, 0): 0.99}
    )
    assert verify_tree(target, tree, 2, N0) == TreeOutcome((0,), (0, 2), True)


# --------------------------------------------------------------------------- statistics at T = 0.7

ALPHA = 0.001
N_STAT = 4000
SHAPE_STAT = (((),), (), ())  # a root with three children, the first of which has one child
# Fixed logits over 4 tokens, the rows of a Markov chain, processed at temperature 0.7.
LOGITS_P = [
    [-1.53, -0.75, -0.65, -1.61],
    [-0.1, -0.61, -0.98, -1.61],
    [-0.71, 0.3, -0.78, -0.25],
    [-0.22, 1.69, 0.23, 0.47],
]
LOGITS_Q = [
    [-0.7, -1.16, 0.7, 0.2],
    [0.87, 0.24, -0.66, 0.81],
    [1.1, -0.18, -2.25, -1.45],
    [0.06, -0.62, -0.8, -0.13],
]
T_07 = SamplingParams(temperature=0.7)
P_STAT = logits_to_probs(torch.tensor(LOGITS_P), T_07, None).numpy()
Q_STAT = logits_to_probs(torch.tensor(LOGITS_Q), T_07, None).numpy()
V_STAT = 4


def draft(Q: np.ndarray, c0: int, shape: Shape, seed: int, position: int) -> DraftTree:
    """The test's sampling draft: each node's children drawn in order without replacement from
    ``Q[its token]`` with the real uniforms ``ranked_uniform(seed, index, DRAFT, k)`` (``k`` counts the
    nodes drawn at that index); nodes in preorder, each carrying its parent's full row."""
    tokens: list[int] = []
    parents: list[int] = []
    qs: list[np.ndarray] = []
    counters: dict[int, int] = defaultdict(int)

    def grow(parent: int, context: int, shapes: Shape, index: int) -> None:
        left, picks = Q[context].copy(), []
        for _ in shapes:
            u = ranked_uniform(seed, index, Purpose.DRAFT, counters[index])
            counters[index] += 1
            cdf = np.cumsum(left)
            picks.append(int(np.searchsorted(cdf, u * cdf[-1], side="right")))
            left[picks[-1]] = 0.0
        for token, sub in zip(picks, shapes, strict=True):
            me = len(tokens)
            tokens.append(token)
            parents.append(parent)
            qs.append(Q[context])
            grow(me, token, sub, index + 1)

    grow(-1, c0, shape, position)
    q = torch.tensor(np.array(qs).reshape(len(tokens), Q.shape[1]), dtype=F64)
    return DraftTree(tuple(tokens), tuple(parents), q)


def written_out_verify_tree(
    target_probs: torch.Tensor,
    tree: DraftTree,
    seed: int,
    position: int,
    *,
    correction_from_p: bool = False,
    without_replacement: bool = True,
) -> TreeOutcome:
    """The rule written out again with a switchable bias, on the real uniforms and the real sampler.

    Unbiased it must agree with ``verify_tree`` (checked on every statistical draw). The biases:
    ``correction_from_p`` samples the correction from ``p_v`` instead of the last residual (the wrong
    verifier docs/design.md warns about); ``without_replacement=False`` keeps each sibling's q whole,
    SpecInfer's with-replacement rule applied to siblings the draft drew without replacement.
    """
    p = target_probs.numpy()
    q = tree.q.numpy()
    node, path = -1, []
    while True:
        index = position + len(path)
        kids = tree.children(node)
        residual, chosen = p[node + 1].copy(), None
        for r, child in enumerate(kids):
            token = tree.tokens[child]
            q_child = q[child].copy()
            if without_replacement and r:
                q_child[[tree.tokens[s] for s in kids[:r]]] = 0.0
                q_child /= q_child.sum()
            if ranked_uniform(seed, index, Purpose.ACCEPT, r) < min(1.0, residual[token] / q_child[token]):
                chosen = child
                break
            residual = np.maximum(residual - q_child, 0.0)
            residual /= residual.sum()
        if chosen is None:
            final = p[node + 1] if correction_from_p else residual
            u = ranked_uniform(seed, index, Purpose.RESAMPLE, 0)
            y = sample_rows(torch.tensor(final[None], dtype=F64), [u])[0]
            return TreeOutcome(tuple(path), (*(tree.tokens[v] for v in path), y), not kids)
        node = chosen
        path.append(node)


def _rows(tree: DraftTree, c0: int) -> torch.Tensor:
    return torch.tensor(P_STAT[[c0, *tree.tokens]], dtype=F64)  # [nodes + 1, V]


def first_two(verifier: Callable, seed_base: int) -> tuple[np.ndarray, np.ndarray]:
    """The first two emitted tokens of N_STAT sessions (distinct seeds, real uniforms); a round that
    emits one token is followed by a second round from it, as the system would."""
    firsts, seconds = [], []
    for seed in range(seed_base, seed_base + N_STAT):
        tree = draft(Q_STAT, 0, SHAPE_STAT, seed, N0)
        block = verifier(_rows(tree, 0), tree, seed, N0).emitted
        if len(block) == 1:
            again = draft(Q_STAT, block[0], SHAPE_STAT, seed, N0 + 1)
            block += verifier(_rows(again, block[0]), again, seed, N0 + 1).emitted
        firsts.append(block[0])
        seconds.append(block[1])
    return np.array(firsts), np.array(seconds)


def exact_first_two(**bias: bool) -> np.ndarray:
    """The exact law ``[V, V]`` of the first two emitted tokens under the model (with ``bias``)."""

    def first(c0: int) -> np.ndarray:
        out = np.zeros(V_STAT)
        for d in draw_trees(Q_STAT, c0, SHAPE_STAT):
            for route in routes(d.tree, P_STAT[[c0, *d.tree.tokens]], **bias):
                out[route.emitted[0]] += d.prob * route.prob
        return out

    firsts = {c: first(c) for c in range(V_STAT)}
    joint = np.zeros((V_STAT, V_STAT))
    for d in draw_trees(Q_STAT, 0, SHAPE_STAT):
        for route in routes(d.tree, P_STAT[[0, *d.tree.tokens]], **bias):
            if len(route.emitted) >= 2:
                joint[route.emitted[0], route.emitted[1]] += d.prob * route.prob
            else:
                joint[route.emitted[0]] += d.prob * route.prob * firsts[route.emitted[0]]
    return joint


def pvalues(firsts: np.ndarray, seconds: np.ndarray) -> dict[str, float]:
    target_joint = P_STAT[0][:, None] * P_STAT
    return {
        "first": stats.chisquare(np.bincount(firsts, minlength=4), N_STAT * target_joint.sum(1)).pvalue,
        "second": stats.chisquare(np.bincount(seconds, minlength=4), N_STAT * target_joint.sum(0)).pvalue,
        "joint": stats.chisquare(
            np.bincount(firsts * 4 + seconds, minlength=16), N_STAT * target_joint.reshape(-1)
        ).pvalue,
    }


BIASES = {"correction from p": {"correction_from_p": True}, "q kept whole": {"without_replacement": False}}


def test_the_biased_verifiers_are_detectable_at_this_sample_size():
    """Power of the chi-square tests below, from the exact model. The real rule's first two tokens equal
    the target's to 1e-12. Noncentrality at N_STAT = 4000, first token (df 3) / pair (df 15): about
    270 / 517 for the correction sampled from p, 343 / 350 for q kept whole; so at alpha = 0.001 each
    test rejects each biased verifier with probability > 1 - 1e-9. The smallest expected cell count
    of the pair is about 20."""
    target_joint = P_STAT[0][:, None] * P_STAT
    np.testing.assert_allclose(exact_first_two(), target_joint, atol=1e-12)
    assert (N_STAT * target_joint).min() > 15
    for name, bias in BIASES.items():
        biased = exact_first_two(**bias)
        for observed, expected, df in [
            (biased.sum(1), target_joint.sum(1), 3),
            (biased.reshape(-1), target_joint.reshape(-1), 15),
        ]:
            lam = N_STAT * float(((observed - expected) ** 2 / expected).sum())
            power = stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, lam)
            assert lam > 250 and power > 1 - 1e-9, (name, df, lam, power)


def test_first_and_second_tokens_follow_the_target_statistically():
    """Chi-square goodness of fit at alpha = 0.001, N_STAT = 4000 sessions with distinct seeds, real
    uniforms, a sampling draft at T = 0.7 drafting three children (the first with a child): the first
    emitted token (df 3), the second (df 3) and the pair (df 15) match the target. The written-out rule
    that the biased verifiers below are made from agrees with the real one on every draw."""
    firsts, seconds = first_two(verify_tree, seed_base=10_000)
    assert min(pvalues(firsts, seconds).values()) >= ALPHA, pvalues(firsts, seconds)
    written_out = first_two(written_out_verify_tree, seed_base=10_000)
    assert np.array_equal(firsts, written_out[0]) and np.array_equal(seconds, written_out[1])
    # Later siblings and corrections were really exercised.
    outcomes = []
    for seed in range(10_000, 10_400):
        tree = draft(Q_STAT, 0, SHAPE_STAT, seed, N0)
        outcomes.append(verify_tree(_rows(tree, 0), tree, seed, N0))
    assert any(o.path[:1] not in ((), (0,)) for o in outcomes)  # a later sibling accepted
    assert any(o.path == () for o in outcomes)  # every child rejected


@pytest.mark.parametrize("name", list(BIASES))
def test_the_same_tests_reject_the_biased_verifiers(name):
    """Same draws, same chi-square tests at alpha = 0.001, N_STAT = 4000: each bias fails the first-token
    and the pair tests."""

    def biased(target, tree, seed, position):
        return written_out_verify_tree(target, tree, seed, position, **BIASES[name])

    result = pvalues(*first_two(biased, seed_base=10_000))
    assert result["first"] < ALPHA and result["joint"] < ALPHA, result


# --------------------------------------------------------------------------- coupled


class ScriptedNoise:
    """A fake of :func:`specserve.core.rng.gumbel_noise` (named as such): ``(seed, position) -> [vocab]``.

    A key not in the table fails the test; ``asked`` records the keys each call asked for.
    """

    def __init__(self) -> None:
        self.table: dict[tuple[int, int], np.ndarray] = {}
        self.asked: list[tuple[int, int]] = []

    def __call__(self, seeds, positions, vocab_size, *, device=None) -> torch.Tensor:
        rows = []
        for key in zip(seeds, positions, strict=True):
            if key not in self.table:
                raise AssertionError(f"the verifier drew noise it should not need: {key}")
            self.asked.append(key)
            rows.append(self.table[key])
        return torch.tensor(np.array(rows).reshape(len(rows), vocab_size), dtype=F64, device=device)


def _winner(token: int, vocab: int = 3) -> np.ndarray:
    """Noise under which ``token`` wins ``argmax(log p + G)`` for any p giving it mass above e**-50."""
    noise = np.zeros(vocab)
    noise[token] = 50.0
    return noise


#   root ─┬─ 0 (tok 1) ─┬─ 2 (tok 0)
#         │             └─ 3 (tok 2)
#         └─ 1 (tok 2) ──── 4 (tok 1)
COUPLED_TREE = DraftTree((1, 2, 0, 2, 1), (-1, -1, 0, 0, 1))


@pytest.mark.parametrize(
    "winners, expected",
    [
        ((2, 1, 0), TreeOutcome((1, 4), (2, 1, 0), True)),  # second sibling, then its leaf, then the bonus
        ((1, 2, 1), TreeOutcome((0, 3), (1, 2, 1), True)),  # first sibling, its second child, the bonus
        ((1, 1, 0), TreeOutcome((0,), (1, 1), False)),  # node 0's children (0, 2) miss y = 1: the correction
        ((0, 2, 2), TreeOutcome((), (0,), False)),  # no child is y = 0 at the root
    ],
)
def test_coupled_walks_the_path_of_the_target_tokens(monkeypatch, winners, expected):
    """The target's token at each depth is argmax(log p + G) with the noise of index n + depth; the
    child equal to it is accepted. The verifier asks for the noise of n, n + 1, n + 2 (one row per
    depth, max_depth = 2) and nothing else."""
    noise = ScriptedNoise()
    monkeypatch.setattr(tree_verification, "gumbel_noise", noise)
    for depth, token in enumerate(winners):
        noise.table[(3, N0 + depth)] = _winner(token)
    target = torch.full((6, 3), 1 / 3, dtype=F64)
    assert verify_tree_coupled(target, COUPLED_TREE, 3, N0) == expected
    assert sorted(noise.asked) == [(3, N0), (3, N0 + 1), (3, N0 + 2)]


def test_coupled_does_not_read_q(monkeypatch):
    """A tree that ships q (even one giving its own tokens probability 0) gets the same verdict."""
    noise = ScriptedNoise()
    monkeypatch.setattr(tree_verification, "gumbel_noise", noise)
    for depth, token in enumerate((2, 1, 0)):
        noise.table[(3, N0 + depth)] = _winner(token)
    q = torch.tensor([[1.0, 0.0, 0.0]] * 5, dtype=F64)
    with_q = DraftTree(COUPLED_TREE.tokens, COUPLED_TREE.parents, q)
    target = torch.full((6, 3), 1 / 3, dtype=F64)
    assert verify_tree_coupled(target, with_q, 3, N0) == verify_tree_coupled(target, COUPLED_TREE, 3, N0)


V_INV = 40


def _markov(seed: int, concentration: float) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.full(V_INV, concentration), size=V_INV)


P_INV = _markov(1, 0.3)
Q_INV = 0.5 * _markov(2, 0.3) + 0.5 * P_INV


def gumbel_top_k_tree(widths: tuple[int, ...]) -> Callable[[int, int, int], DraftTree]:
    """A coupled draft: every node of depth ``d`` gets the top ``widths[d - 1]`` tokens of
    ``log Q[its token] + G`` as children, ``G`` the noise of their index (Gumbel-top-k: samples without
    replacement from Q, coupled to the target's noise). ``widths = (1,) * gamma`` is the chain's coupled
    draft; ``()`` proposes nothing."""

    def build(prev: int, seed: int, position: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1, prev)]
        for depth, width in enumerate(widths):
            noise = gumbel_noise([seed], [position + depth], V_INV)[0].numpy()
            nxt = []
            for parent, context in frontier:
                with np.errstate(divide="ignore"):
                    scores = np.log(Q_INV[context]) + noise
                for token in np.argsort(-scores, kind="stable")[:width]:
                    tokens.append(int(token))
                    parents.append(parent)
                    nxt.append((len(tokens) - 1, int(token)))
            frontier = nxt
        return DraftTree(tuple(tokens), tuple(parents))

    return build


def random_tree(prev: int, seed: int, position: int) -> DraftTree:
    """Random tokens in a random shape, unrelated to the noise."""
    rng = np.random.default_rng([seed, position])
    tokens: list[int] = []
    parents: list[int] = []
    for _ in range(int(rng.integers(1, 9))):
        parent = int(rng.integers(-1, len(tokens)))
        taken = {tokens[i] for i in range(len(tokens)) if parents[i] == parent}
        token = int(rng.choice([t for t in range(V_INV) if t not in taken]))
        tokens.append(token)
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


DRAFTS = {
    "none": gumbel_top_k_tree(()),
    "chain": gumbel_top_k_tree((1, 1, 1)),
    "wide": gumbel_top_k_tree((3, 2, 1)),
    "deep": gumbel_top_k_tree((2, 1, 1, 1, 1, 1)),
    "random": random_tree,
}


def generate(build: Callable[[int, int, int], DraftTree], seed: int, length: int) -> list[int]:
    """Rounds of ``build(prev, seed, position)`` trees through ``verify_tree_coupled`` (real noise)."""
    tokens, position, prev = [], N0, 0
    while len(tokens) < length:
        tree = build(prev, seed, position)
        target = torch.tensor(P_INV[[prev, *tree.tokens]], dtype=F64)  # [nodes + 1, V]
        block = verify_tree_coupled(target, tree, seed, position).emitted
        tokens += block
        position, prev = position + len(block), block[-1]
    return tokens[:length]


def target_only(seed: int, length: int) -> list[int]:
    """Target-only Gumbel-max sampling with the same noise, written out: y_j = argmax(log P[y_{j-1}] + G_j)."""
    out, prev = [], 0
    for j in range(length):
        noise = gumbel_noise([seed], [N0 + j], V_INV)[0].numpy()
        with np.errstate(divide="ignore"):
            prev = int(np.argmax(np.log(P_INV[prev]) + noise))
        out.append(prev)
    return out


def test_coupled_output_is_the_same_whatever_the_tree():
    """For 40 seeds, 14 tokens each: no draft (the target alone), a chain, a wide tree, a deep tree and
    random trees all emit exactly the target-only Gumbel-max sequence of the seed."""
    for seed in range(40):
        want = target_only(seed, 14)
        for name, build in DRAFTS.items():
            assert generate(build, seed, 14) == want, (name, seed)


def test_a_wider_coupled_tree_accepts_at_least_what_its_chain_does():
    """From the same state, the wide tree (which holds the chain's path: the top-1 token at each depth)
    accepts at least as many tokens as the chain, and more in some rounds; its block extends the
    chain's, both being prefixes of the one target-only sequence."""
    more = 0
    for seed in range(20):
        position, prev, emitted = N0, 0, 0
        while emitted < 14:
            verdicts = {}
            for name in ("chain", "wide"):
                tree = DRAFTS[name](prev, seed, position)
                target = torch.tensor(P_INV[[prev, *tree.tokens]], dtype=F64)
                verdicts[name] = verify_tree_coupled(target, tree, seed, position)
            chain_block, wide_block = verdicts["chain"].emitted, verdicts["wide"].emitted
            assert verdicts["wide"].accepted >= verdicts["chain"].accepted
            assert wide_block[: len(chain_block)] == chain_block
            more += verdicts["wide"].accepted > verdicts["chain"].accepted
            position, prev, emitted = position + len(chain_block), chain_block[-1], emitted + len(chain_block)
    assert more > 0


# --------------------------------------------------------------------------- greedy

# The argmax after the root and after each node of test_tree.py's worked tree:
#   root ─┬─ 0 (tok 5) ─┬─ 2 (tok 1) ── 4 (tok 2)
#         │             └─ 3 (tok 2)
#         └─ 1 (tok 7) ──── 5 (tok 5)
GREEDY_TREE = DraftTree(tokens=(5, 7, 1, 2, 2, 5), parents=(-1, -1, 0, 0, 2, 1))
X = 8  # an entry off the path: never read
GREEDY_CASES = {
    "the deepest branch, then the bonus": ([5, 1, X, 2, X, 9, X], TreeOutcome((0, 2, 4), (5, 1, 2, 9), True)),
    "the second sibling": ([7, X, 5, X, X, X, 3], TreeOutcome((1, 5), (7, 5, 3), True)),
    "the second child at depth 2": ([5, 2, X, X, 0, X, X], TreeOutcome((0, 3), (5, 2, 0), True)),
    "a mismatch at the root": ([4, X, X, X, X, X, X], TreeOutcome((), (4,), False)),
    "a mismatch below": ([5, 9, X, X, X, X, X], TreeOutcome((0,), (5, 9), False)),
    "a mismatch at depth 3": ([5, 1, X, 0, X, X, X], TreeOutcome((0, 2), (5, 1, 0), False)),
}


@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_case(name):
    """The longest path matching the target's argmax; the argmax after it. The optimal and coupled rules
    on one-hot targets (what greedy processing gives) agree, for any seed, with point-mass and dense q."""
    argmax, expected = GREEDY_CASES[name]
    assert verify_tree_greedy(torch.tensor(argmax), GREEDY_TREE) == expected
    one_hot = torch.nn.functional.one_hot(torch.tensor(argmax), 10).to(F64)  # [nodes + 1, 10]
    q = torch.softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(0), dtype=F64), -1)
    dense = DraftTree(GREEDY_TREE.tokens, GREEDY_TREE.parents, q)
    for seed in (0, 1, 2**63):
        assert verify_tree(one_hot, GREEDY_TREE, seed, 5) == expected
        assert verify_tree(one_hot, dense, seed, 5) == expected
        assert verify_tree_coupled(one_hot, GREEDY_TREE, seed, 5) == expected


def test_greedy_ties_take_the_lowest_token_id():
    """Ties are broken by the target's argmax (greedy_tokens: the lowest id among equal scores, as HF
    greedy decoding); siblings are distinct, so the tree itself never has a tie."""
    from specserve.core.sampling import greedy_tokens

    scores = torch.tensor([[2.0, 5.0, 5.0, 1.0]])
    argmax = greedy_tokens(scores)  # [1]: token 1, not 2
    assert argmax.tolist() == [1]
    table = torch.tensor([int(argmax[0]), 0, 0])
    assert verify_tree_greedy(table, DraftTree((2, 1), (-1, -1))) == TreeOutcome((1,), (1, 0), True)
    assert verify_tree_greedy(table[:2], DraftTree((2,), (-1,))) == TreeOutcome((), (1,), False)


def test_greedy_empty_tree_emits_the_argmax():
    assert verify_tree_greedy(torch.tensor([6]), DraftTree((), ())) == TreeOutcome((), (6,), True)


# --------------------------------------------------------------------------- chains are the special case


def _verdict(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as error:  # the same error class on both sides counts as the same verdict
        return type(error)


@settings(max_examples=300, deadline=None)
@given(
    vocab=st.integers(2, 6),
    gamma=st.integers(0, 5),
    data_seed=st.integers(0, 2**32 - 1),
    q_kind=st.sampled_from(["dense", "point", "dense, any token"]),
    seed=st.integers(0, 2**64 - 1),
    position=st.integers(0, 2**40),
    removed=st.booleans(),
)
def test_a_chain_shaped_tree_gives_the_chain_rules_verdict(
    vocab, gamma, data_seed, q_kind, seed, position, removed
):
    """Each tree rule on ``DraftTree.from_chain`` returns exactly the chain rule's verdict (or raises the
    same error: a token the draft gave probability 0), for random p and q (with tokens removed by
    the processing when ``removed``), any seed and position."""
    rng = np.random.default_rng(data_seed)

    def rows(n: int) -> torch.Tensor:
        logits = rng.normal(size=(n, vocab)) * 2
        if removed:
            logits[rng.random((n, vocab)) < 0.3] = -np.inf
            logits[np.arange(n), rng.integers(vocab, size=n)] = 0.0  # at least one token stays
        return torch.softmax(torch.tensor(logits, dtype=F64), -1)  # [n, vocab]

    p = rows(gamma + 1)  # [gamma + 1, vocab]
    q = rows(gamma) if q_kind != "point" else None  # [gamma, vocab]
    if q_kind == "dense":
        tokens = tuple(int(rng.choice(vocab, p=row / row.sum())) for row in q.numpy())
    else:
        tokens = tuple(int(t) for t in rng.integers(vocab, size=gamma))
    proposal, tree = DraftProposal(tokens, q), DraftTree.from_chain(tokens, q)

    def as_chain(verdict):
        return verdict.as_verify_outcome() if isinstance(verdict, TreeOutcome) else verdict

    chain_optimal = _verdict(lambda: verify_batch(p[None], [proposal], [seed], [position])[0])
    assert as_chain(_verdict(lambda: verify_tree(p, tree, seed, position))) == chain_optimal
    chain_coupled = _verdict(lambda: verify_coupled(p[None], [proposal], [seed], [position])[0])
    assert as_chain(_verdict(lambda: verify_tree_coupled(p, tree, seed, position))) == chain_coupled
    argmax = p.argmax(-1)  # [gamma + 1]
    assert verify_tree_greedy(argmax, tree).as_verify_outcome() == verify_greedy(argmax[None], [proposal])[0]


def test_from_chain_tree_outcome_lists_the_accepted_prefix():
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]], dtype=F64)
    outcome = verify_tree(p, DraftTree.from_chain([1, 0]), 0, 0)
    assert outcome.path == (0, 1) and outcome.bonus and outcome.emitted[:2] == (1, 0)
    assert outcome.accepted == 2 and outcome.next_token == outcome.emitted[-1]


# --------------------------------------------------------------------------- determinism


def test_the_verdict_is_a_function_of_seed_and_position():
    """The same call gives the same verdict; other seeds or positions give others (the numbers are keyed
    by them, not drawn from a stream)."""
    tree = draft(Q_STAT, 0, SHAPE_STAT, 1, N0)
    target = _rows(tree, 0)
    verdicts = [verify_tree(target, tree, seed, N0) for seed in range(200)]
    assert verdicts == [verify_tree(target, tree, seed, N0) for seed in range(200)]
    assert len(set(verdicts)) > 3
    assert verdicts != [verify_tree(target, tree, seed, N0 + 1) for seed in range(200)]


# --------------------------------------------------------------------------- impossible branches


def _exact_raises(error_type, call):
    with pytest.raises(error_type) as info:
        call()
    assert info.type is error_type, info.type


UNIFORM3 = [1 / 3, 1 / 3, 1 / 3]


def test_zero_draft_probability_at_any_node():
    """A node whose q gives its own token 0 raises, even where the walk would never reach it (node 1
    comes after a sure acceptance of node 0)."""
    q = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], dtype=F64)
    tree = DraftTree((0, 2), (-1, -1), q)
    target = torch.tensor([[1.0, 0.0, 0.0], UNIFORM3, UNIFORM3], dtype=F64)
    _exact_raises(ZeroDraftProbability, lambda: verify_tree(target, tree, 0, 0))


def test_zero_residual_mass(scripted):
    """p <= q everywhere (p sums to 0.9995, within tolerance) yet the child is rejected."""
    tree = DraftTree((1,), (-1,), torch.tensor([[0.4, 0.6]], dtype=F64))
    target = torch.tensor([[0.4, 0.5995], [0.5, 0.5]], dtype=F64)
    scripted.load(0, {(0, Purpose.ACCEPT, 0): 0.9999, (0, Purpose.RESAMPLE, 0): 0.5})
    _exact_raises(ZeroResidualMass, lambda: verify_tree(target, tree, 0, 0))


@pytest.mark.parametrize(
    "row, which",
    [
        ([0.3, float("nan"), 0.7], "target"),
        ([0.3, 0.3, 0.3], "target"),  # sums to 0.9
        ([float("inf"), float("-inf"), 1.0], "target"),
        ([0.2, 0.9, -0.1], "draft"),  # negative
        ([0.2, 0.3, 0.4], "draft"),  # sums to 0.9
        ([0.5, 0.5, float("nan")], "draft"),
    ],
)
def test_invalid_distribution_in_any_row(row, which):
    """The last row (after node 1, never reached when node 0 is surely accepted) is checked too."""
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]], dtype=F64)
    target = torch.tensor([[1.0, 0.0, 0.0], UNIFORM3, UNIFORM3], dtype=F64)
    if which == "target":
        target[2] = torch.tensor(row, dtype=F64)
    else:
        q[1] = torch.tensor(row, dtype=F64)
    tree = DraftTree((0, 1), (-1, -1), q)
    _exact_raises(InvalidDistribution, lambda: verify_tree(target, tree, 0, 0))
    if which == "target":
        _exact_raises(InvalidDistribution, lambda: verify_tree_coupled(target, tree, 0, 0))


def test_invalid_arguments():
    tree = DraftTree((1, 2), (-1, 0))
    target = torch.full((3, 3), 1 / 3, dtype=F64)  # [nodes + 1, vocab]
    for rule in (verify_tree, verify_tree_coupled):
        _exact_raises(InvalidArgument, lambda rule=rule: rule(target[:2], tree, 0, 0))  # rows != nodes + 1
        _exact_raises(InvalidArgument, lambda rule=rule: rule(target[0], tree, 0, 0))  # not [rows, vocab]
        _exact_raises(
            InvalidArgument, lambda rule=rule: rule(target[:, :2], tree, 0, 0)
        )  # token 2 >= vocab 2
        _exact_raises(InvalidArgument, lambda rule=rule: rule(target, tree, 0, -1))  # negative position
        _exact_raises(InvalidArgument, lambda rule=rule: rule(target, tree, 2**64, 0))  # seed out of range
        with_q = DraftTree((1, 2), (-1, 0), torch.full((2, 4), 0.25, dtype=F64))
        _exact_raises(VocabularyMismatch, lambda rule=rule, with_q=with_q: rule(target, with_q, 0, 0))
    _exact_raises(InvalidArgument, lambda: verify_tree_greedy(torch.tensor([1, 2]), tree))
    _exact_raises(InvalidArgument, lambda: verify_tree_greedy(torch.tensor([[1, 2, 0]]), tree))
