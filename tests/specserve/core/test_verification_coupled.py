"""The coupled rule (``verify_coupled``): exact enumeration, drafter invariance, statistics.

The coupled rule's tests are their own file: they need their own exact model of
the randomness (below), while ``test_verification.py`` covers the rejection
sampler that shares the module.

The toy language model is the Markov chain of ``test_verification.py``: the
target's next-token distribution after token ``t`` is ``P[t]``, the draft's
``Q[t]``. In a round after the committed token ``c0`` the draft proposes
``x_i = argmax(log Q[x_{i-1}] + G_i)`` and the target's token is
``y_i = argmax(log P[x_{i-1}] + G_i)``, ``G_i`` the Gumbel noise at that position.

**The exact model.** With ``E_t = exp(-G_t)`` i.i.d. Exp(1), ``argmax(log w + G)``
is ``argmin(E / w)`` (an exponential race). For one position the joint law of
``(x, y)`` under shared noise is then, for ``x = y = a``::

    J[a, a] = 1 / sum_t max(q_t / q_a, p_t / p_a)

and for ``x = b != y = a``, writing ``r = (E_a / p_a) / (E_b / q_b)``::

    J[b, a] = p_a q_b  integral over r in (q_a / p_a, q_b / p_b) of  dr / L(r)^2,
    L(r) = r p_a + q_b + sum_{t not in {a, b}} max(q_t, r p_t)

``L`` is piecewise linear in ``r`` (breaks at ``q_t / p_t``), so each piece
integrates in closed form. :func:`coupling_joint` computes ``J`` this way and
a test checks its marginals are ``q`` and ``p`` to 1e-12. Every outcome of a
round (the ``(x_i, y_i)`` of each position and the bonus ``y_{gamma+1}``) then
has an exact probability, and a noise vector realising it (:func:`realise`) is
scripted into the real ``verify_coupled`` (:class:`ScriptedNoise`, a fake of
``gumbel_noise`` that fails the test when asked for a position it should not
need). Summing the emitted blocks' probabilities, completed by target-only
sampling, gives the target's distribution to 1e-9; a verifier with the
classic vectorisation bug (accepting the *number* of matching positions instead
of the matching *prefix*) is off by more than 1e-2.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

import specserve.core.verification as verification
from specserve.api.errors import InvalidArgument
from specserve.core.proposal import DraftProposal
from specserve.core.rng import gumbel_noise
from specserve.core.sampling import gumbel_argmax
from specserve.core.verification import VerifyOutcome, verify_coupled

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.unit]

F64 = torch.float64
N0 = 7  # sequence index of the first proposed token


# --------------------------------------------------------------------------- the exact model


def coupling_joint(q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``J[b, a]`` = P(argmax(log q + G) = b and argmax(log p + G) = a), G i.i.d. Gumbel (module docstring)."""
    vocab = len(p)
    joint = np.zeros((vocab, vocab))
    for a, b in itertools.product(range(vocab), repeat=2):
        if p[a] == 0 or q[b] == 0:
            continue
        if a == b:
            joint[a, a] = 1.0 / sum(max(q[t] / q[a], p[t] / p[a]) for t in range(vocab))
            continue
        lo = q[a] / p[a]
        hi = q[b] / p[b] if p[b] > 0 else math.inf
        if not lo < hi:
            continue
        others = [t for t in range(vocab) if t not in (a, b)]
        breaks = sorted({q[t] / p[t] for t in others if p[t] > 0 and lo < q[t] / p[t] < hi})
        points = [lo, *breaks, hi]
        total = 0.0
        for r1, r2 in itertools.pairwise(points):
            mid = (r1 + r2) / 2 if math.isfinite(r2) else r1 + 1.0
            alpha = q[b] + sum(q[t] for t in others if q[t] >= mid * p[t])  # L(r) = alpha + beta r here
            beta = p[a] + sum(p[t] for t in others if q[t] < mid * p[t])

            def antiderivative(r: float, alpha=alpha, beta=beta) -> float:
                return 0.0 if math.isinf(r) else -1.0 / (beta * (alpha + beta * r))

            total += antiderivative(r2) - antiderivative(r1)
        joint[b, a] = p[a] * q[b] * total
    return joint


def realise(q: np.ndarray, p: np.ndarray, b: int, a: int) -> np.ndarray:
    """A Gumbel noise vector with argmax(log q + G) = b and argmax(log p + G) = a (inside the event, with margin)."""
    vocab = len(p)
    race = np.empty(vocab)  # E_t = exp(-G_t)
    if a == b:
        race[:] = [2.0 * max(q[t] / q[a], p[t] / p[a]) + 1.0 for t in range(vocab)]
        race[a] = 1.0
    else:
        lo = q[a] / p[a]
        hi = q[b] / p[b] if p[b] > 0 else math.inf
        r = (lo + hi) / 2 if math.isfinite(hi) else lo + 1.0
        race[:] = [2.0 * max(q[t], r * p[t]) + 1.0 for t in range(vocab)]
        race[b], race[a] = q[b], r * p[a]
    noise = -np.log(race)
    with np.errstate(divide="ignore"):
        assert int(np.argmax(np.log(q) + noise)) == b and int(np.argmax(np.log(p) + noise)) == a
    return noise


@dataclass(frozen=True)
class Cell:
    """One outcome of a round: the draft's x, the target's y (gamma + 1 of them), its probability, the noise."""

    x: tuple[int, ...]
    y: tuple[int, ...]
    prob: float
    noise: tuple[np.ndarray, ...]  # one vector per position

    @property
    def first_mismatch(self) -> int:
        return next(
            (i for i, (xi, yi) in enumerate(zip(self.x, self.y, strict=False)) if xi != yi), len(self.x)
        )


def round_cells(P: np.ndarray, Q: np.ndarray, c0: int, gamma: int) -> list[Cell]:
    """Every (x_1..x_gamma, y_1..y_{gamma+1}) with its exact probability under shared noise, and noise realising it."""
    vocab = P.shape[0]
    joints = [coupling_joint(Q[c], P[c]) for c in range(vocab)]
    cells: list[Cell] = []

    def extend(prev: int, x: tuple, y: tuple, prob: float, noise: tuple) -> None:
        if len(x) == gamma:
            for a in range(vocab):
                if P[prev, a] > 0:
                    bonus = realise(P[prev], P[prev], a, a)
                    cells.append(Cell(x, (*y, a), prob * P[prev, a], (*noise, bonus)))
            return
        for b, a in itertools.product(range(vocab), repeat=2):
            if joints[prev][b, a] > 0:
                g = realise(Q[prev], P[prev], b, a)
                extend(b, (*x, b), (*y, a), prob * joints[prev][b, a], (*noise, g))

    extend(c0, (), (), 1.0, ())
    return cells


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


class ScriptedNoise:
    """A fake of :func:`specserve.core.rng.gumbel_noise` (named as such): a table ``(seed, position) -> [vocab]``.

    Asking for a key not in the table fails the test, so a verifier that draws noise
    for a position it should not (a padding row, the wrong offset) is caught.
    """

    def __init__(self) -> None:
        self.table: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, seeds, positions, vocab_size, *, device=None) -> torch.Tensor:
        rows = []
        for key in zip(seeds, positions, strict=True):
            if key not in self.table:
                raise AssertionError(f"the verifier drew noise it should not need: {key}")
            rows.append(self.table[key])
        return torch.tensor(np.array(rows).reshape(len(rows), vocab_size), dtype=F64, device=device)


@pytest.fixture
def scripted(monkeypatch) -> ScriptedNoise:
    fake = ScriptedNoise()
    monkeypatch.setattr(verification, "gumbel_noise", fake)
    return fake


def count_matches_verifier(target_probs, proposals, seeds, positions) -> list[VerifyOutcome]:
    """The classic bug of a vectorised accept step: ``accepted = (x == y).sum()`` instead of the
    length of the matching prefix (a ``cumprod``). Target tokens and noise are the real ones."""
    outcomes = []
    for proposal, y in zip(proposals, target_tokens(target_probs, proposals, seeds, positions), strict=True):
        accepted = sum(int(x == t) for x, t in zip(proposal.token_ids, y, strict=False))
        outcomes.append(VerifyOutcome(accepted, y[accepted], accepted == proposal.gamma))
    return outcomes


def target_tokens(target_probs, proposals, seeds, positions) -> list[list[int]]:
    """``y_i = argmax(log p_i + G_i)`` at every used position of every row, with the module's noise function."""
    out = []
    for b, proposal in enumerate(proposals):
        steps = proposal.gamma + 1
        noise = verification.gumbel_noise(
            [seeds[b]] * steps, [positions[b] + i for i in range(steps)], target_probs.shape[-1]
        )  # [gamma + 1, vocab]
        out.append(gumbel_argmax(target_probs[b, :steps], noise).tolist())
    return out


def emitted_distribution(
    scripted: ScriptedNoise, cells: list[Cell], P: np.ndarray, c0: int, verifier: Callable = verify_coupled
) -> dict[tuple[int, ...], float]:
    """Drive ``verifier`` through every cell (the real one must reach exactly the cell's outcome); the
    emitted block of each, completed to ``gamma + 1`` tokens by target-only sampling, weighted by its probability."""
    gamma = len(cells[0].x)
    scripted.table.clear()
    for seed, cell in enumerate(cells):
        for i, g in enumerate(cell.noise):
            scripted.table[(seed, N0 + i)] = g
    target = torch.tensor(np.stack([P[[c0, *cell.x]] for cell in cells]), dtype=F64)  # [cells, gamma+1, V]
    proposals = [DraftProposal(cell.x) for cell in cells]
    outcomes = verifier(target, proposals, list(range(len(cells))), [N0] * len(cells))
    completed: dict[tuple[int, ...], float] = defaultdict(float)
    for cell, outcome in zip(cells, outcomes, strict=True):
        if verifier is verify_coupled:
            k = cell.first_mismatch
            assert outcome == VerifyOutcome(k, cell.y[k], k == gamma), cell
        block = outcome.emitted(cell.x)
        for tail, prob in chain(P, block[-1], gamma + 1 - len(block)).items():
            completed[block + tail] += cell.prob * prob
    return completed


def worst_error(completed: dict[tuple[int, ...], float], P: np.ndarray, c0: int, length: int) -> float:
    expected = chain(P, c0, length)
    assert set(completed) <= set(expected), "emitted a sequence the target gives probability 0"
    return max(abs(completed.get(seq, 0.0) - prob) for seq, prob in expected.items())


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def dirichlet(rng: np.random.Generator, vocab: int) -> np.ndarray:
    return rng.dirichlet(np.ones(vocab), size=vocab)  # [V, V], rows sum to 1


def zero_some(rng: np.random.Generator, M: np.ndarray, per_row: int) -> np.ndarray:
    M = M.copy()
    for row in M:
        row[rng.choice(len(row), per_row, replace=False)] = 0.0
    return M / M.sum(-1, keepdims=True)


# --------------------------------------------------------------------------- the exact model is right


@pytest.mark.parametrize("seed", range(6))
def test_the_coupling_joint_has_the_right_marginals_and_acceptance(seed):
    """Sanity of the exact model: marginals q and p to 1e-12; the agreement probability lies between
    the communication-free bound (1 - TV) / (1 + TV) and the optimal coupling's 1 - TV (Daliri et al.)."""
    rng = np.random.default_rng(seed)
    vocab = 2 + seed
    p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab) * 0.5)
    if seed % 2:
        p[0] = 0.0  # a token the target never picks (top-k / top-p removed it)
        p /= p.sum()
    joint = coupling_joint(q, p)
    np.testing.assert_allclose(joint.sum(axis=0), p, atol=1e-12)
    np.testing.assert_allclose(joint.sum(axis=1), q, atol=1e-12)
    agree, d = float(np.trace(joint)), tv(p, q)
    assert (1 - d) / (1 + d) - 1e-12 <= agree <= 1 - d + 1e-12


def test_the_coupling_of_a_distribution_with_itself_always_agrees():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    np.testing.assert_allclose(coupling_joint(p, p), np.diag(p), atol=1e-15)


# --------------------------------------------------------------------------- exact enumeration


@pytest.mark.parametrize("vocab, gamma", [(2, 1), (2, 3), (3, 1), (3, 2), (4, 2), (4, 3), (5, 2)], ids=str)
def test_exact_distribution_random(scripted, vocab, gamma):
    """Random P and Q: the coupled verifier's output, completed by target-only sampling, is the
    target's to 1e-9; the count-the-matches verifier misses it by more than 1e-2 on the same cells."""
    rng = np.random.default_rng(200 * vocab + gamma)
    P, Q = dirichlet(rng, vocab), dirichlet(rng, vocab)
    cells = round_cells(P, Q, 0, gamma)
    ks = {cell.first_mismatch for cell in cells}
    assert 0 in ks and gamma in ks  # rejections at the first position and full acceptance both happen
    assert worst_error(emitted_distribution(scripted, cells, P, 0), P, 0, gamma + 1) <= 1e-9
    if gamma >= 2:  # the bug needs a mismatch followed by a match
        biased = emitted_distribution(scripted, cells, P, 0, count_matches_verifier)
        assert worst_error(biased, P, 0, gamma + 1) > 1e-2


def test_exact_distribution_with_tokens_removed(scripted):
    """Zeros in P (top-k / top-p) and in Q (a truncated draft): removed tokens are never emitted."""
    rng = np.random.default_rng(11)
    P, Q = zero_some(rng, dirichlet(rng, 5), 2), zero_some(rng, dirichlet(rng, 5), 1)
    cells = round_cells(P, Q, 3, 2)
    assert worst_error(emitted_distribution(scripted, cells, P, 3), P, 3, 3) <= 1e-9


def test_exact_distribution_disjoint_supports(scripted):
    """P lives on {0, 1}, Q on {2, 3}: nothing is ever accepted and every round emits y_1."""
    P = np.array([[0.7, 0.3, 0, 0], [0.4, 0.6, 0, 0], [0.5, 0.5, 0, 0], [0.1, 0.9, 0, 0]])
    Q = np.array([[0, 0, 0.2, 0.8], [0, 0, 0.5, 0.5], [0, 0, 0.6, 0.4], [0, 0, 0.3, 0.7]])
    cells = round_cells(P, Q, 3, 2)
    assert {cell.first_mismatch for cell in cells} == {0}
    assert worst_error(emitted_distribution(scripted, cells, P, 3), P, 3, 3) <= 1e-9


def test_exact_distribution_identical_draft_is_always_accepted(scripted):
    rng = np.random.default_rng(12)
    P = zero_some(rng, dirichlet(rng, 4), 1)
    cells = round_cells(P, P.copy(), 1, 3)
    assert {cell.first_mismatch for cell in cells} == {3}
    assert worst_error(emitted_distribution(scripted, cells, P, 1), P, 1, 4) <= 1e-9


def test_a_ragged_batch_draws_noise_only_for_its_own_positions(scripted):
    """Rows of gamma 0, 1 and 3 in one call: each row asks for positions n..n+gamma_b and nothing else
    (the scripted noise fails on any other key), and gets its own outcome."""
    P = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    noise = {0: [0.0, 3.0, 0.0], 1: [2.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0]}  # y = 1, 0, argmax p
    proposals = [DraftProposal(()), DraftProposal((1,)), DraftProposal((1, 2, 0))]
    for seed, proposal in enumerate(proposals):
        for i in range(proposal.gamma + 1):
            scripted.table[(seed, 10 * seed + i)] = np.array(noise[i % 3])
    target = torch.zeros((3, 4, 3), dtype=F64)  # [batch, max_gamma + 1, vocab]; padding stays 0
    for b, proposal in enumerate(proposals):
        rows = [0, *proposal.token_ids]
        target[b, : len(rows)] = torch.tensor(P[rows])
    outcomes = verify_coupled(target, proposals, [0, 1, 2], [0, 10, 20])
    assert outcomes[0] == VerifyOutcome(0, 1, True)  # gamma 0: y_1 = argmax(log P[0] + [0, 3, 0]) = 1
    assert outcomes[1] == VerifyOutcome(1, 0, True)  # x_1 = 1 = y_1; bonus argmax(log P[1] + [2, 0, 0]) = 0
    assert outcomes[2] == VerifyOutcome(1, 0, False)  # x_1 = 1 matches, x_2 = 2 != y_2 = 0


def test_proposal_distributions_are_ignored(scripted):
    """A draft that ships q anyway (an optimal-mode draft during an upgrade): the same verdict."""
    P = np.array([[0.6, 0.4], [0.3, 0.7]])
    scripted.table.update({(5, 0): np.array([0.0, 1.0]), (5, 1): np.array([0.0, 0.0])})
    target = torch.tensor(P[[0, 1]], dtype=F64).unsqueeze(0)  # [1, 2, 2]
    q = torch.tensor([[0.1, 0.9]], dtype=F64)
    plain = verify_coupled(target, [DraftProposal((1,))], [5], [0])
    with_q = verify_coupled(target, [DraftProposal((1,), q)], [5], [0])
    assert plain == with_q == [VerifyOutcome(1, 1, True)]


def test_invalid_arguments():
    p = torch.full((1, 2, 3), 1 / 3, dtype=F64)
    with pytest.raises(InvalidArgument):
        verify_coupled(p, [DraftProposal((1, 2))], [0], [0])  # 2 tokens need 3 rows
    with pytest.raises(InvalidArgument):
        verify_coupled(p, [DraftProposal((5,))], [0], [0])  # token outside the vocabulary
    with pytest.raises(InvalidArgument):
        verify_coupled(p, [DraftProposal((1,))], [0, 1], [0])
    assert verify_coupled(torch.zeros((0, 1, 3), dtype=F64), [], [], []) == []


# --------------------------------------------------------------------------- drafter invariance, real noise

V_INV = 50
GAMMAS = (1, 2, 4)


def _markov(seed: int, vocab: int, concentration: float) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.full(vocab, concentration), size=vocab)


def _generate(
    P, draft: Callable[[int, int, int], int], seed: int, gamma: int, length: int
) -> tuple[list[int], int, int]:
    """Rounds of ``gamma`` proposals from ``draft(prev, seed, position)`` through ``verify_coupled`` (real
    noise) until ``length`` tokens; returns (tokens, proposed, accepted)."""
    tokens, proposed, accepted, position, prev = [], 0, 0, N0, 0
    while len(tokens) < length:
        x, p_prev = [], prev
        for i in range(gamma):
            p_prev = draft(p_prev, seed, position + i)
            x.append(p_prev)
        rows = torch.tensor(P[[prev, *x]], dtype=F64).unsqueeze(0)  # [1, gamma + 1, V]
        [outcome] = verify_coupled(rows, [DraftProposal(tuple(x))], [seed], [position])
        block = outcome.emitted(x)
        tokens += block
        proposed, accepted = proposed + gamma, accepted + outcome.accepted
        position, prev = position + len(block), block[-1]
    return tokens[:length], proposed, accepted


def _target_only(P, seed: int, length: int) -> list[int]:
    """Target-only Gumbel-max sampling with the same noise, written out: y_j = argmax(log P[y_{j-1}] + G_j)."""
    out, prev = [], 0
    for j in range(length):
        noise = gumbel_noise([seed], [N0 + j], P.shape[1])[0].numpy()
        with np.errstate(divide="ignore"):
            prev = int(np.argmax(np.log(P[prev]) + noise))
        out.append(prev)
    return out


def test_the_output_is_target_only_sampling_whatever_the_draft():
    """For 40 seeds and gamma in {1, 2, 4}, 12 tokens each: a draft with the same noise, the same draft
    with a perturbed seed's noise, a deterministic (n-gram-like) draft and a draft of random tokens all
    give exactly the target-only Gumbel-max sequence. The perturbed noise costs acceptance only: per
    position the exact agreement is 0.60 with shared noise (the optimal rule's 1 - TV: 0.64) and 0.05
    with independent noise, so over all rounds it accepts less than half as often."""
    P, Q = _markov(1, V_INV, 0.3), _markov(2, V_INV, 0.3) * 0.5 + _markov(1, V_INV, 0.3) * 0.5

    def coupled(prev, seed, position):
        noise = gumbel_noise([seed], [position], V_INV)[0].numpy()
        return int(np.argmax(np.log(Q[prev]) + noise))

    def perturbed(prev, seed, position):
        return coupled(prev, seed + 1_000_003, position)

    def deterministic(prev, seed, position):
        return (prev * 7 + 3) % V_INV

    rng = np.random.default_rng(0)

    def random_tokens(prev, seed, position):
        return int(rng.integers(V_INV))

    rates = defaultdict(lambda: [0, 0])
    for seed, gamma in itertools.product(range(40), GAMMAS):
        want = _target_only(P, seed, 12)
        for name, draft in [
            ("coupled", coupled),
            ("perturbed", perturbed),
            ("det", deterministic),
            ("random", random_tokens),
        ]:
            tokens, proposed, accepted = _generate(P, draft, seed, gamma, 12)
            assert tokens == want, (name, seed, gamma)
            rates[name][0] += proposed
            rates[name][1] += accepted
    coupled_rate = rates["coupled"][1] / rates["coupled"][0]
    perturbed_rate = rates["perturbed"][1] / rates["perturbed"][0]
    assert coupled_rate > 0.3 and perturbed_rate < 0.5 * coupled_rate, (coupled_rate, perturbed_rate)


# --------------------------------------------------------------------------- statistics, real noise

ALPHA = 0.001
N_STAT = 4000
GAMMA_STAT = 2
P_STAT = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])
Q_STAT = np.array([[0.6, 0.1, 0.3], [0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])


def _round(verifier, contexts: Sequence[int], seeds: Sequence[int], position: int) -> list[tuple[int, ...]]:
    """One round for many sessions with real noise: the coupled draft, then ``verifier``."""
    drafted, prev = [], list(contexts)
    for i in range(GAMMA_STAT):
        noise = gumbel_noise(list(seeds), [position + i] * len(seeds), 3)  # [n, 3]
        prev = gumbel_argmax(torch.tensor(Q_STAT[prev], dtype=F64), noise).tolist()
        drafted.append(prev)
    xs = list(zip(*drafted, strict=True))
    target = torch.tensor(np.stack([P_STAT[[c, *x]] for c, x in zip(contexts, xs, strict=True)]), dtype=F64)
    outcomes = verifier(target, [DraftProposal(x) for x in xs], list(seeds), [position] * len(seeds))
    return [outcome.emitted(x) for outcome, x in zip(outcomes, xs, strict=True)]


def _first_two(verifier, seed_base: int) -> tuple[np.ndarray, np.ndarray]:
    seeds = list(range(seed_base, seed_base + N_STAT))
    blocks = _round(verifier, [0] * N_STAT, seeds, N0)
    short = [j for j, block in enumerate(blocks) if len(block) == 1]
    assert short
    seconds = _round(verifier, [blocks[j][0] for j in short], [seeds[j] for j in short], N0 + 1)
    for j, block in zip(short, seconds, strict=True):
        blocks[j] = blocks[j] + block[:1]
    return np.array([b[0] for b in blocks]), np.array([b[1] for b in blocks])


def _exact_first_two(emit: Callable[[Cell], tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Exact P(first) and P(first, second) of a verifier that emits ``emit(cell)`` (no noise scripting)."""

    def first(c0: int) -> np.ndarray:
        out = np.zeros(3)
        for cell in round_cells(P_STAT, Q_STAT, c0, GAMMA_STAT):
            out[emit(cell)[0]] += cell.prob
        return out

    joint = np.zeros((3, 3))
    for cell in round_cells(P_STAT, Q_STAT, 0, GAMMA_STAT):
        block = emit(cell)
        if len(block) >= 2:
            joint[block[0], block[1]] += cell.prob
        else:
            joint[block[0]] += cell.prob * first(block[0])
    return joint.sum(1), joint


def _emit_real(cell: Cell) -> tuple[int, ...]:
    return cell.y[: cell.first_mismatch + 1]


def _emit_count_matches(cell: Cell) -> tuple[int, ...]:
    accepted = sum(int(x == y) for x, y in zip(cell.x, cell.y, strict=False))
    return (*cell.x[:accepted], cell.y[accepted])


def _pvalues(firsts: np.ndarray, seconds: np.ndarray) -> dict[str, float]:
    target_first = P_STAT[0]
    target_joint = target_first[:, None] * P_STAT
    return {
        "first": stats.chisquare(np.bincount(firsts, minlength=3), N_STAT * target_first).pvalue,
        "second": stats.chisquare(np.bincount(seconds, minlength=3), N_STAT * target_joint.sum(0)).pvalue,
        "joint": stats.chisquare(
            np.bincount(firsts * 3 + seconds, minlength=9), N_STAT * target_joint.reshape(-1)
        ).pvalue,
    }


def test_the_biased_verifier_is_detectable_at_this_sample_size():
    """Power of the chi-square tests below against the count-the-matches verifier, from the exact model:
    the real rule's first two tokens equal the target's to 1e-12; the biased one's noncentrality at
    N_STAT = 4000 is lambda = 443 for the first token (df 2) and 484 for the pair (df 8), so at
    alpha = 0.001 each test rejects it with probability > 1 - 1e-9."""
    target_first = P_STAT[0]
    target_joint = target_first[:, None] * P_STAT
    real_first, real_joint = _exact_first_two(_emit_real)
    np.testing.assert_allclose(real_joint, target_joint, atol=1e-12)
    np.testing.assert_allclose(real_first, target_first, atol=1e-12)
    biased_first, biased_joint = _exact_first_two(_emit_count_matches)
    for observed, expected, df in [
        (biased_first, target_first, 2),
        (biased_joint.reshape(-1), target_joint.reshape(-1), 8),
    ]:
        lam = N_STAT * float(((observed - expected) ** 2 / expected).sum())
        power = stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, lam)
        assert lam > 400 and power > 1 - 1e-9, (lam, power)


def test_first_and_second_tokens_follow_the_target_statistically():
    """Chi-square at alpha = 0.001, N_STAT = 4000 sessions with distinct seeds, gamma = 2, the real noise
    and a coupled draft: the first token (df 2), the second (df 2) and the pair (df 8) match the target."""
    firsts, seconds = _first_two(verify_coupled, seed_base=5_000)
    pvalues = _pvalues(firsts, seconds)
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_the_same_test_rejects_the_count_the_matches_verifier():
    """Same draws, same tests at alpha = 0.001: the biased verifier fails the first-token and joint tests."""
    firsts, seconds = _first_two(count_matches_verifier, seed_base=5_000)
    pvalues = _pvalues(firsts, seconds)
    assert pvalues["first"] < ALPHA and pvalues["joint"] < ALPHA, pvalues
