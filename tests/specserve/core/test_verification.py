"""The exact speculative verifier: worked example, exact small-vocabulary distributions, statistics,
greedy cases, seeded determinism, impossible branches, and the wire form of draft distributions.

The toy language model used throughout is a Markov chain on a small vocabulary:
the target's next-token distribution after token ``t`` is ``P[t]``, the
draft's is ``Q[t]``. A round after the committed token ``c0`` has the draft
propose ``x_1..x_gamma`` (``x_i ~ Q[x_{i-1}]``), and the target rows are
``P[c0], P[x_1], ..., P[x_gamma]``, exactly what a real target computes.
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
from specserve.api.errors import (
    InvalidArgument,
    InvalidDistribution,
    VocabularyMismatch,
    ZeroDraftProbability,
    ZeroResidualMass,
)
from specserve.api.params import SamplingParams
from specserve.core.proposal import DraftProposal, dense_from_sparse, draft_probs_from_pb, draft_probs_to_pb
from specserve.core.rng import Purpose, uniform
from specserve.core.sampling import check_distribution, logits_to_probs, sample_rows
from specserve.core.verification import (
    VerifyOutcome,
    acceptance_probs,
    residual_distribution,
    verify_batch,
    verify_greedy,
)
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.unit]

F64 = torch.float64
N0 = 7  # sequence index of the first proposed token in the exact and statistical tests


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


class ScriptedUniforms:
    """A fake of :func:`specserve.core.rng.uniform` (named as such): a table ``(seed, position, purpose) -> u``.

    Asking for a key that is not in the table fails the test, so a verifier that
    draws a number it should not (wrong position, wrong purpose, a test after the
    first rejection) is caught.
    """

    def __init__(self) -> None:
        self.table: dict[tuple[int, int, Purpose], float] = {}

    def set(self, seed: int, position: int, purpose: Purpose, value: float) -> None:
        self.table[(seed, position, Purpose(purpose))] = value

    def __call__(self, seed: int, position: int, purpose: Purpose) -> float:
        key = (seed, position, Purpose(purpose))
        if key not in self.table:
            raise AssertionError(f"the verifier drew a uniform it should not need: {key}")
        return self.table[key]


@pytest.fixture
def scripted(monkeypatch) -> ScriptedUniforms:
    fake = ScriptedUniforms()
    monkeypatch.setattr(verification, "uniform", fake)
    return fake


# --------------------------------------------------------------------------- worked example


def test_worked_example():
    """p = [0.5, 0.3, 0.2], q = [0.6, 0.1, 0.3] (the issue's example)."""
    p, q = f64([0.5, 0.3, 0.2]), f64([0.6, 0.1, 0.3])
    accept = acceptance_probs(p, q)
    torch.testing.assert_close(accept, f64([5 / 6, 1.0, 2 / 3]), rtol=0, atol=1e-15)
    accepted_mass = float((q * accept).sum())
    assert accepted_mass == pytest.approx(0.8, abs=1e-15)
    correction = residual_distribution(p, q)
    assert torch.equal(correction, f64([0.0, 1.0, 0.0]))
    recovered = q * accept + (1.0 - accepted_mass) * correction
    torch.testing.assert_close(recovered, p, rtol=0, atol=1e-15)


def test_worked_example_through_verify_batch(scripted):
    """The verifier accepts x = 0 iff u < 5/6 and otherwise corrects to token 1 whatever the resample uniform."""
    p, q = f64([0.5, 0.3, 0.2]), f64([0.6, 0.1, 0.3])
    ratio = float(acceptance_probs(p, q)[0])  # 5/6 as the verifier computes it
    target = torch.stack([p, f64([0.1, 0.1, 0.8])]).unsqueeze(0)  # [1, 2, 3]
    proposal = DraftProposal((0,), q.unsqueeze(0))
    cases = [(0.0, 0.5), (math.nextafter(ratio, 0.0), 0.05), (ratio, 0.0), (0.99, 0.99)]
    for seed, (u_accept, u_other) in enumerate(cases):
        scripted.set(seed, 3, Purpose.ACCEPT, u_accept)
        scripted.set(seed, 3, Purpose.RESAMPLE, u_other)  # the correction: any value gives token 1
        scripted.set(
            seed, 4, Purpose.RESAMPLE, u_other
        )  # the bonus after an acceptance, from [0.1, 0.1, 0.8]
        [outcome] = verify_batch(target, [proposal], [seed], [3])
        if u_accept < ratio:
            assert outcome == VerifyOutcome(accepted=1, next_token=2 if u_other >= 0.2 else 0, bonus=True)
        else:
            assert outcome == VerifyOutcome(accepted=0, next_token=1, bonus=False)


# --------------------------------------------------------------------------- exact small vocabularies


@dataclass(frozen=True)
class Cell:
    """One outcome of a round: draft tokens x, first rejection (or gamma) k, next token y, and its probability."""

    x: tuple[int, ...]
    k: int
    y: int
    prob: float
    p_rows: torch.Tensor  # [gamma+1, V]
    q_rows: torch.Tensor | None  # [gamma, V]; None = point masses
    accept: tuple[float, ...]  # acceptance probability of each x_i
    dist: torch.Tensor  # [V] the distribution y is sampled from


def _round_cells(
    P: torch.Tensor,
    Q: torch.Tensor | None,
    c0: int,
    gamma: int,
    *,
    proposer: Sequence[int] = (),
    correction: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual_distribution,
) -> list[Cell]:
    """Every outcome of one round with its exact probability, from the verifier's own helpers.

    ``Q is None``: the draft is the deterministic point-mass proposer ``x_i = proposer[x_{i-1}]``.
    ``correction`` may be swapped to analyse a biased verifier.
    """
    vocab = P.shape[0]
    cells: list[Cell] = []
    for x in itertools.product(range(vocab), repeat=gamma):
        prevs = (c0, *x)
        if Q is None:
            if any(x[i] != proposer[prevs[i]] for i in range(gamma)):
                continue
            weight, q_rows = 1.0, None
            q_dense = torch.nn.functional.one_hot(torch.tensor(x, dtype=torch.int64), vocab).to(F64)
        else:
            weight = math.prod(float(Q[prevs[i], x[i]]) for i in range(gamma))
            q_rows = q_dense = Q[list(prevs[:gamma])]
        if weight == 0.0:
            continue
        p_rows = P[list(prevs)]
        accept = tuple(float(acceptance_probs(p_rows[i], q_dense[i])[x[i]]) for i in range(gamma))
        reach = weight
        for k in range(gamma + 1):
            if k < gamma:
                stop = reach * (1.0 - accept[k])
                dist = correction(p_rows[k], q_dense[k]) if stop > 0 else None
            else:
                stop, dist = reach, p_rows[gamma]
            if stop > 0:
                assert dist is not None
                cells += [
                    Cell(x, k, y, stop * float(dist[y]), p_rows, q_rows, accept, dist)
                    for y in range(vocab)
                    if dist[y] > 0
                ]
            if k < gamma:
                reach *= accept[k]
    return cells


def _chain(P: torch.Tensor, start: int, length: int) -> dict[tuple[int, ...], float]:
    """Target-only sampling: the probability of each continuation of ``length`` tokens after ``start``."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(P.shape[0]), repeat=length):
        prob, prev = 1.0, start
        for token in seq:
            prob *= float(P[prev, token])
            prev = token
        out[seq] = prob
    return out


def _probe(cell: Cell, variant: str) -> list[tuple[int, Purpose, float]]:
    """Uniforms that must lead the verifier to ``cell``: mid-interval, or at either end of each interval."""
    draws: list[tuple[int, Purpose, float]] = []
    for i in range(cell.k):  # accepted: u in [0, a_i)
        a = cell.accept[i]
        u = {"mid": a / 2, "low": 0.0, "high": math.nextafter(a, 0.0)}[variant]
        draws.append((N0 + i, Purpose.ACCEPT, u))
    gamma = len(cell.x)
    if cell.k < gamma:  # rejected: u in [a_k, 1)
        a = cell.accept[cell.k]
        u = {"mid": (a + 1) / 2, "low": a, "high": math.nextafter(1.0, 0.0)}[variant]
        draws.append((N0 + cell.k, Purpose.ACCEPT, u))
    cdf = torch.cumsum(cell.dist, 0)
    total = float(cdf[-1])
    lo = float(cdf[cell.y - 1]) if cell.y else 0.0
    hi = float(cdf[cell.y])
    u = {"mid": (lo + hi) / 2, "low": lo + 1e-6 * (hi - lo), "high": hi - 1e-6 * (hi - lo)}[variant] / total
    draws.append((N0 + cell.k, Purpose.RESAMPLE, u))
    return draws


def _check_exact(scripted: ScriptedUniforms, cells: list[Cell], P: torch.Tensor, c0: int, gamma: int):
    """Drive the real ``verify_batch`` through every cell; return the emitted distribution vs the target's."""
    rows = [(cell, variant) for cell in cells for variant in ("mid", "low", "high")]
    for seed, (cell, variant) in enumerate(rows):
        for position, purpose, u in _probe(cell, variant):
            scripted.set(seed, position, purpose, u)
    target = torch.stack([cell.p_rows for cell, _ in rows])  # [R, gamma+1, V]
    proposals = [DraftProposal(cell.x, cell.q_rows) for cell, _ in rows]
    outcomes = verify_batch(target, proposals, list(range(len(rows))), [N0] * len(rows))
    completed: dict[tuple[int, ...], float] = defaultdict(float)
    for (cell, variant), outcome in zip(rows, outcomes, strict=True):
        assert outcome == VerifyOutcome(cell.k, cell.y, cell.k == gamma), (cell, variant)
        if variant == "mid":
            block = outcome.emitted(cell.x)
            for tail, prob in _chain(P, block[-1], gamma + 1 - len(block)).items():
                completed[block + tail] += cell.prob * prob
    expected = _chain(P, c0, gamma + 1)
    worst = max(abs(completed.get(seq, 0.0) - prob) for seq, prob in expected.items())
    assert set(completed) <= set(expected)
    assert worst <= 1e-9, worst
    return outcomes


def _dirichlet(rng: np.random.Generator, vocab: int) -> torch.Tensor:
    return torch.from_numpy(rng.dirichlet(np.ones(vocab), size=vocab))  # [V, V] rows sum to 1


def _zero_some(rng: np.random.Generator, M: torch.Tensor, per_row: int) -> torch.Tensor:
    M = M.clone()
    for row in M:
        row[torch.from_numpy(rng.choice(len(row), per_row, replace=False))] = 0.0
    return M / M.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "vocab, gamma", [(2, 1), (2, 3), (3, 1), (3, 2), (4, 3), (5, 1), (5, 2), (5, 3)], ids=lambda v: str(v)
)
def test_exact_distribution_random(scripted, vocab, gamma):
    """Random P and Q: the verifier's output, completed by target-only sampling, is the target's, to 1e-9."""
    rng = np.random.default_rng(100 * vocab + gamma)
    P, Q = _dirichlet(rng, vocab), _dirichlet(rng, vocab)
    cells = _round_cells(P, Q, 0, gamma)
    assert any(cell.k < gamma for cell in cells) and any(cell.k == gamma for cell in cells)
    _check_exact(scripted, cells, P, 0, gamma)


def test_exact_distribution_q_zero_where_p_positive(scripted):
    rng = np.random.default_rng(1)
    P = _dirichlet(rng, 4)
    Q = _zero_some(rng, _dirichlet(rng, 4), 2)
    assert bool(((Q == 0) & (P > 0)).any())
    _check_exact(scripted, _round_cells(P, Q, 1, 2), P, 1, 2)


def test_exact_distribution_p_zero_where_q_positive(scripted):
    rng = np.random.default_rng(2)
    P = _zero_some(rng, _dirichlet(rng, 4), 2)
    Q = _dirichlet(rng, 4)
    cells = _round_cells(P, Q, 2, 3)
    assert any(cell.accept[cell.k] == 0.0 for cell in cells if cell.k < 3)  # sure rejections happen
    _check_exact(scripted, cells, P, 2, 3)


def test_exact_distribution_disjoint_supports(scripted):
    """P lives on {0, 1}, Q on {2, 3}: every draft token is rejected and the correction is p itself."""
    P = f64([[0.7, 0.3, 0, 0], [0.4, 0.6, 0, 0], [0.5, 0.5, 0, 0], [0.1, 0.9, 0, 0]])
    Q = f64([[0, 0, 0.2, 0.8], [0, 0, 0.5, 0.5], [0, 0, 0.6, 0.4], [0, 0, 0.3, 0.7]])
    cells = _round_cells(P, Q, 3, 2)
    assert {cell.k for cell in cells} == {0}
    outcomes = _check_exact(scripted, cells, P, 3, 2)
    assert all(outcome.accepted == 0 and not outcome.bonus for outcome in outcomes)


def test_exact_distribution_identical(scripted):
    """Q == P: everything is accepted, the bonus follows, and nothing is NaN."""
    rng = np.random.default_rng(3)
    P = _zero_some(rng, _dirichlet(rng, 5), 1)
    cells = _round_cells(P, P.clone(), 0, 3)
    assert all(cell.k == 3 for cell in cells)
    outcomes = _check_exact(scripted, cells, P, 0, 3)
    assert all(outcome.bonus and outcome.accepted == 3 for outcome in outcomes)
    assert not bool(acceptance_probs(P, P).isnan().any())


def test_exact_distribution_residual_mass_below_1e_12(scripted):
    """Q differs from P by 1e-13 per row: rejections are rare and their residual has mass 1e-13."""
    rng = np.random.default_rng(4)
    P = _dirichlet(rng, 3)
    Q = P.clone()
    Q[:, 0] += 1e-13
    Q[:, 1] -= 1e-13
    mass = (P - Q).clamp(min=0).sum(-1)
    assert bool(((mass > 0) & (mass < 1e-12)).all())
    cells = _round_cells(P, Q, 1, 2)
    assert any(cell.k < 2 for cell in cells)
    _check_exact(scripted, cells, P, 1, 2)


def test_exact_distribution_point_mass_proposals(scripted):
    """An n-gram-like deterministic proposer (probs=None): q is a point mass on each token."""
    rng = np.random.default_rng(5)
    P = _zero_some(rng, _dirichlet(rng, 4), 1)
    proposer = (1, 2, 3, 0)
    P[1, 2] = 0.0  # one proposed token the target never picks
    P = P / P.sum(-1, keepdim=True)
    for c0 in range(4):
        cells = _round_cells(P, None, c0, 3, proposer=proposer)
        _check_exact(scripted, cells, P, c0, 3)
        scripted.table.clear()


def test_exact_distribution_sparse_wire_draft(scripted):
    """A top-2 truncated draft shipped sparse as float32: verification with what the target parsed is exact."""
    rng = np.random.default_rng(6)
    P = _dirichlet(rng, 5)
    logits = torch.from_numpy(rng.normal(size=(5, 5)) * 2)
    q32 = logits_to_probs(logits, SamplingParams(top_k=2), None).to(torch.float32)
    Q = draft_probs_from_pb(draft_probs_to_pb(q32, sparse=True), 5)
    assert bool(((Q > 0).sum(-1) == 2).all())
    _check_exact(scripted, _round_cells(P, Q, 4, 2), P, 4, 2)


# --------------------------------------------------------------------------- statistics

ALPHA = 0.001
N_STAT = 4000
GAMMA_STAT = 2
CTX = 0
# Toy chain for the statistical tests; row 0 is the worked example.
P_STAT = f64([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])
Q_STAT = f64([[0.6, 0.1, 0.3], [0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])


def biased_verify_batch(target_probs, proposals, seeds, positions) -> list[VerifyOutcome]:
    """The wrong verifier docs/design.md warns about: a rejected token is replaced by a plain sample of p_i
    instead of the residual norm(max(0, p_i - q_i)). Acceptance and randomness are the real ones.
    (Proposals here all have probs and the same length.)"""
    batch = len(proposals)
    gamma = proposals[0].gamma
    x = torch.tensor([proposal.token_ids for proposal in proposals])  # [batch, gamma]
    q = torch.stack([proposal.probs for proposal in proposals])  # [batch, gamma, V]
    rows, steps = torch.arange(batch)[:, None], torch.arange(gamma)[None, :]
    ratios = acceptance_probs(target_probs[rows, steps, x], q[rows, steps, x]).tolist()  # [batch][gamma]
    stops = []
    for b in range(batch):
        stop = gamma
        for i in range(gamma):
            if not uniform(seeds[b], positions[b] + i, Purpose.ACCEPT) < ratios[b][i]:
                stop = i
                break
        stops.append(stop)
    chosen = target_probs[torch.arange(batch), torch.tensor(stops)]  # [batch, V]
    us = [uniform(seeds[b], positions[b] + stops[b], Purpose.RESAMPLE) for b in range(batch)]
    tokens = sample_rows(chosen, us)
    return [VerifyOutcome(stops[b], tokens[b], stops[b] == gamma) for b in range(batch)]


def _simulate_round(verifier, contexts: list[int], seeds: list[int], position: int) -> list[tuple[int, ...]]:
    """One real round for many sessions: the draft samples with DRAFT uniforms, then ``verifier``."""
    drafted, prev = [], contexts
    for i in range(GAMMA_STAT):
        us = [uniform(seed, position + i, Purpose.DRAFT) for seed in seeds]
        prev = sample_rows(Q_STAT[prev], us)
        drafted.append(prev)
    xs = list(zip(*drafted, strict=True))  # per session: (x_1, .., x_gamma)
    chains = [[c, *x] for c, x in zip(contexts, xs, strict=True)]
    target = P_STAT[torch.tensor(chains)]  # [n, gamma+1, V]
    proposals = [DraftProposal(x, Q_STAT[chain[:-1]]) for x, chain in zip(xs, chains, strict=True)]
    outcomes = verifier(target, proposals, seeds, [position] * len(seeds))
    return [outcome.emitted(x) for outcome, x in zip(outcomes, xs, strict=True)]


def _first_two(verifier, seed_base: int) -> tuple[np.ndarray, np.ndarray]:
    """The first two emitted tokens of N_STAT sessions (seeds seed_base..), running a second round if needed."""
    seeds = list(range(seed_base, seed_base + N_STAT))
    blocks = _simulate_round(verifier, [CTX] * N_STAT, seeds, N0)
    short = [j for j, block in enumerate(blocks) if len(block) == 1]
    assert short  # with acceptance 0.8 per token, many sessions need a second round
    seconds = _simulate_round(verifier, [blocks[j][0] for j in short], [seeds[j] for j in short], N0 + 1)
    for j, block in zip(short, seconds, strict=True):
        blocks[j] = blocks[j] + block[:1]
    return np.array([b[0] for b in blocks]), np.array([b[1] for b in blocks])


def _exact_first_two(correction) -> tuple[np.ndarray, np.ndarray]:
    """Exact P(first token) and P(first, second) of a verifier using ``correction`` at a rejection."""

    def first(c0: int) -> np.ndarray:
        out = np.zeros(3)
        for cell in _round_cells(P_STAT, Q_STAT, c0, GAMMA_STAT, correction=correction):
            out[(*cell.x[: cell.k], cell.y)[0]] += cell.prob
        return out

    joint = np.zeros((3, 3))
    for cell in _round_cells(P_STAT, Q_STAT, CTX, GAMMA_STAT, correction=correction):
        block = (*cell.x[: cell.k], cell.y)
        if len(block) >= 2:
            joint[block[0], block[1]] += cell.prob
        else:
            joint[block[0]] += cell.prob * first(block[0])
    return joint.sum(1), joint


def _pvalues(firsts: np.ndarray, seconds: np.ndarray) -> dict[str, float]:
    target_first = P_STAT[CTX].numpy()
    target_joint = target_first[:, None] * P_STAT.numpy()
    observed_joint = np.bincount(firsts * 3 + seconds, minlength=9)
    return {
        "first": stats.chisquare(np.bincount(firsts, minlength=3), N_STAT * target_first).pvalue,
        "second": stats.chisquare(np.bincount(seconds, minlength=3), N_STAT * target_joint.sum(0)).pvalue,
        "joint": stats.chisquare(observed_joint, N_STAT * target_joint.reshape(-1)).pvalue,
    }


def test_biased_verifier_is_detectable_at_this_sample_size():
    """Power of the chi-square tests below against the biased verifier, from its exact distribution.

    Per-sample noncentrality sum((b - t)^2 / t): first token 0.0933, second token 0.0599, joint 0.190;
    with N_STAT = 4000 that is lambda = 373 (df 2), 240 (df 2), 760 (df 8), so at alpha = 0.001 each
    test rejects the biased verifier with probability > 1 - 1e-12. The real verifier's exact
    distribution equals the target's (its bias is < 1e-12).
    """
    target_first = P_STAT[CTX].numpy()
    target_joint = target_first[:, None] * P_STAT.numpy()
    real_first, real_joint = _exact_first_two(residual_distribution)
    np.testing.assert_allclose(real_joint, target_joint, atol=1e-12)
    np.testing.assert_allclose(real_first, target_first, atol=1e-12)
    biased_first, biased_joint = _exact_first_two(lambda p, q: p)
    for observed, expected, df in [
        (biased_first, target_first, 2),
        (biased_joint.sum(0), target_joint.sum(0), 2),
        (biased_joint.reshape(-1), target_joint.reshape(-1), 8),
    ]:
        lam = N_STAT * float(((observed - expected) ** 2 / expected).sum())
        power = stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, lam)
        assert lam > 200 and power > 1 - 1e-9, (lam, power)


def test_first_and_second_tokens_follow_the_target_statistically():
    """Chi-square goodness of fit at alpha = 0.001, N_STAT = 4000 sessions with distinct seeds, gamma = 2,
    real uniforms: the first emitted token (df 2), the second (df 2) and the pair (df 8) match the target.
    The same tests reject the biased verifier (next test)."""
    firsts, seconds = _first_two(verify_batch, seed_base=1_000)
    pvalues = _pvalues(firsts, seconds)
    assert min(pvalues.values()) >= ALPHA, pvalues
    # Rejections really happened, so the correction path was exercised.
    assert np.mean(firsts != np.array(_first_draft_tokens(1_000))) > 0.05


def _first_draft_tokens(seed_base: int) -> list[int]:
    us = [uniform(seed, N0, Purpose.DRAFT) for seed in range(seed_base, seed_base + N_STAT)]
    return sample_rows(Q_STAT[[CTX] * N_STAT], us)


def test_the_same_tests_reject_the_biased_verifier():
    """Same draws, same chi-square tests, alpha = 0.001, N_STAT = 4000: the plain-target replacement fails."""
    firsts, seconds = _first_two(biased_verify_batch, seed_base=1_000)
    pvalues = _pvalues(firsts, seconds)
    assert all(p < ALPHA for p in pvalues.values()), pvalues


# --------------------------------------------------------------------------- greedy

GREEDY_CASES = {
    "all_accepted_bonus": ((3, 1, 4), [3, 1, 4, 7], VerifyOutcome(3, 7, True)),
    "first_mismatch": ((2, 1, 4), [3, 1, 4, 7], VerifyOutcome(0, 3, False)),
    "middle_mismatch": ((3, 5, 4), [3, 1, 4, 7], VerifyOutcome(1, 1, False)),
    "last_mismatch": ((3, 1, 5), [3, 1, 4, 7], VerifyOutcome(2, 4, False)),
    "empty_proposal": ((), [6], VerifyOutcome(0, 6, True)),
    "short_proposal": ((2,), [2, 0], VerifyOutcome(1, 0, True)),
}
PAD = 9  # never a right answer: reading padding shows up


def _greedy_batch(names):
    width = max(len(GREEDY_CASES[n][1]) for n in names)
    argmax = torch.tensor([GREEDY_CASES[n][1] + [PAD] * (width - len(GREEDY_CASES[n][1])) for n in names])
    return argmax, [GREEDY_CASES[n][0] for n in names], [GREEDY_CASES[n][2] for n in names]


def _one_hot_target(argmax: torch.Tensor, tokens: list[tuple[int, ...]], vocab: int = 10) -> torch.Tensor:
    probs = torch.nn.functional.one_hot(argmax, vocab).to(F64)  # [batch, width, vocab]
    for b, ids in enumerate(tokens):
        probs[b, len(ids) + 1 :] = float("nan")  # padding is never read, not even validated
    return probs


@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_case(name):
    argmax, tokens, expected = _greedy_batch([name])
    assert verify_greedy(argmax, [DraftProposal(t) for t in tokens]) == expected
    target = _one_hot_target(argmax, tokens)
    for seed in (0, 1, 2**63):
        assert verify_batch(target, [DraftProposal(t) for t in tokens], [seed], [5]) == expected


def test_greedy_ragged_batch():
    """All cases in one ragged batch, for verify_greedy and verify_batch (point-mass and one-hot q)."""
    names = list(GREEDY_CASES)
    argmax, tokens, expected = _greedy_batch(names)
    assert verify_greedy(argmax, [DraftProposal(t) for t in tokens]) == expected
    target = _one_hot_target(argmax, tokens)
    seeds, positions = list(range(len(names))), [11 * b for b in range(len(names))]
    assert verify_batch(target, [DraftProposal(t) for t in tokens], seeds, positions) == expected
    one_hot = [
        DraftProposal(
            t, torch.nn.functional.one_hot(torch.tensor(t, dtype=torch.int64), 10).to(F64).reshape(len(t), 10)
        )
        for t in tokens
    ]
    assert verify_batch(target, one_hot, seeds, positions) == expected


# --------------------------------------------------------------------------- determinism


def _random_batch(seed: int, rows: int = 12, vocab: int = 50):
    generator = torch.Generator().manual_seed(seed)
    gammas = [b % 5 for b in range(rows)]
    width = max(gammas) + 1
    target = torch.softmax(torch.randn(rows, width, vocab, generator=generator, dtype=F64) * 2, -1)
    proposals = []
    for b, gamma in enumerate(gammas):
        q = torch.softmax(torch.randn(gamma, vocab, generator=generator, dtype=F64) * 2, -1)
        us = [uniform(500 + b, 40 + i, Purpose.DRAFT) for i in range(gamma)]
        proposals.append(DraftProposal(tuple(sample_rows(q, us)), q))
    return target, proposals, [500 + b for b in range(rows)], [40] * rows


def test_same_seed_same_tokens_whatever_the_batch():
    target, proposals, seeds, positions = _random_batch(0)
    reference = verify_batch(target, proposals, seeds, positions)
    assert reference == verify_batch(target, proposals, seeds, positions)
    assert len({(o.accepted, o.bonus) for o in reference}) > 2  # rejections and bonuses both occur
    # Permuted.
    order = [7, 2, 11, 0, 5, 9, 1, 3, 10, 4, 8, 6]
    permuted = verify_batch(
        target[order], [proposals[b] for b in order], [seeds[b] for b in order], positions
    )
    assert permuted == [reference[b] for b in order]
    # Alone.
    for b in range(len(proposals)):
        width = proposals[b].gamma + 1
        assert verify_batch(target[b : b + 1, :width], [proposals[b]], [seeds[b]], [40]) == [reference[b]]
    # Among other sessions (other seeds, other lengths).
    other_target, other_proposals, other_seeds, other_positions = _random_batch(1, rows=7)
    mixed = verify_batch(
        torch.cat([other_target, target]),
        other_proposals + proposals,
        [s + 1000 for s in other_seeds] + seeds,
        other_positions + positions,
    )
    assert mixed[7:] == reference


def test_mixed_proposal_kinds_in_one_batch():
    """Dense q, point masses, and empty proposals (with probs None or an empty [0, vocab] tensor) side by
    side: each row's outcome is the one it gets alone."""
    generator = torch.Generator().manual_seed(9)
    vocab = 20
    target = torch.softmax(torch.randn(5, 4, vocab, generator=generator, dtype=F64), -1)
    q = torch.softmax(torch.randn(3, vocab, generator=generator, dtype=F64), -1)
    proposals = [
        DraftProposal((), torch.zeros(0, vocab, dtype=F64)),
        DraftProposal((4, 5, 6), None),
        DraftProposal((int(q[0].argmax()), int(q[1].argmax()), int(q[2].argmax())), q),
        DraftProposal((), None),
        DraftProposal((1,), None),
    ]
    seeds, positions = [3, 1, 4, 1, 5], [0, 10, 20, 30, 40]
    together = verify_batch(target, proposals, seeds, positions)
    for b, proposal in enumerate(proposals):
        alone = verify_batch(target[b : b + 1], [proposal], [seeds[b]], [positions[b]])
        assert alone == [together[b]]
    assert together[0].bonus and together[0].accepted == 0 and together[3].bonus


def test_the_seed_matters():
    target, proposals, seeds, positions = _random_batch(0)
    reference = verify_batch(target, proposals, seeds, positions)
    shifted = verify_batch(target, proposals, [s + 1 for s in seeds], positions)
    assert shifted != reference


def test_empty_proposal_samples_p1_with_the_resample_uniform():
    p = f64([0.2, 0.3, 0.5])
    for seed in range(20):
        [outcome] = verify_batch(p.reshape(1, 1, 3), [DraftProposal(())], [seed], [9])
        u = uniform(seed, 9, Purpose.RESAMPLE)
        assert outcome == VerifyOutcome(0, 0 if u < 0.2 else 1 if u < 0.5 else 2, True)


# --------------------------------------------------------------------------- impossible branches


def _exact_raises(error_type, call):
    with pytest.raises(error_type) as info:
        call()
    assert info.type is error_type, info.type


def test_zero_draft_probability():
    target = f64([[0.3, 0.3, 0.4], [0.2, 0.2, 0.6]]).unsqueeze(0)
    proposal = DraftProposal((2,), f64([[0.5, 0.5, 0.0]]))
    _exact_raises(ZeroDraftProbability, lambda: verify_batch(target, [proposal], [0], [0]))


def test_zero_draft_probability_outside_a_sparse_support():
    wire = [
        common_pb2.DraftDistribution(
            sparse=common_pb2.SparseDistribution(token_ids=[0, 1], probs=[0.25, 0.75])
        )
    ]
    q = draft_probs_from_pb(wire, 3)
    assert torch.equal(q, f64([[0.25, 0.75, 0.0]]))
    target = f64([[0.3, 0.3, 0.4], [0.2, 0.2, 0.6]]).unsqueeze(0)
    _exact_raises(ZeroDraftProbability, lambda: verify_batch(target, [DraftProposal((2,), q)], [0], [0]))


@pytest.mark.parametrize(
    "p0, q0",
    [
        ([0.3, float("nan"), 0.7], [0.2, 0.3, 0.5]),
        ([0.3, 0.3, 0.3], [0.2, 0.3, 0.5]),  # target sums to 0.9
        ([0.3, 0.3, 0.4], [0.2, 0.9, -0.1]),  # negative draft entry
        ([0.3, 0.3, 0.4], [0.2, 0.3, float("inf")]),
        ([0.3, 0.3, 0.4], [0.2, 0.3, 0.4]),  # draft sums to 0.9
        ([0.3, 0.3, 0.4], [1.2, 0.0, -0.2]),  # sums to 1, one entry negative
        ([0.3, float("-inf"), 0.7], [0.2, 0.3, 0.5]),
        ([float("inf"), float("-inf"), 1.0], [0.2, 0.3, 0.5]),  # the infinities' sum is NaN
    ],
)
def test_invalid_distribution(p0, q0):
    target = torch.stack([f64(p0), f64([0.2, 0.2, 0.6])]).unsqueeze(0)
    proposal = DraftProposal((0,), f64([q0]))
    _exact_raises(InvalidDistribution, lambda: verify_batch(target, [proposal], [0], [0]))


def test_zero_residual_mass(scripted):
    """p <= q everywhere (p sums to 0.9995, within tolerance) yet x is rejected: max(0, p - q) is empty."""
    _exact_raises(ZeroResidualMass, lambda: residual_distribution(f64([0.4, 0.6]), f64([0.4, 0.6])))
    target = f64([[0.4, 0.5995], [0.5, 0.5]]).unsqueeze(0)
    proposal = DraftProposal((1,), f64([[0.4, 0.6]]))
    scripted.set(0, 0, Purpose.ACCEPT, 0.9999)  # above 0.5995 / 0.6: a rejection
    scripted.set(0, 0, Purpose.RESAMPLE, 0.5)
    _exact_raises(ZeroResidualMass, lambda: verify_batch(target, [proposal], [0], [0]))


def test_invalid_arguments():
    target = f64([[0.3, 0.3, 0.4], [0.2, 0.2, 0.6]]).unsqueeze(0)  # [1, 2, 3]
    q = f64([[0.2, 0.3, 0.5]])
    _exact_raises(InvalidArgument, lambda: verify_batch(target, [DraftProposal((3,), None)], [0], [0]))
    _exact_raises(InvalidArgument, lambda: verify_batch(target, [DraftProposal((1,), q)], [0, 1], [0]))
    _exact_raises(InvalidArgument, lambda: verify_batch(target, [DraftProposal((1, 1), None)], [0], [0]))
    _exact_raises(InvalidArgument, lambda: verify_batch(target, [DraftProposal((1,), q)], [0], [-1]))
    _exact_raises(InvalidArgument, lambda: verify_batch(target[0], [DraftProposal((1,), q)], [0], [0]))
    _exact_raises(InvalidArgument, lambda: DraftProposal((1, 2), q))
    _exact_raises(InvalidArgument, lambda: DraftProposal((-1,), None))
    _exact_raises(
        VocabularyMismatch, lambda: verify_batch(target, [DraftProposal((1,), f64([[0.5, 0.5]]))], [0], [0])
    )
    _exact_raises(InvalidArgument, lambda: verify_greedy(torch.tensor([[1]]), [DraftProposal((1,))]))
    _exact_raises(InvalidArgument, lambda: verify_greedy(torch.tensor([[1, 2]]), []))


# --------------------------------------------------------------------------- wire form


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_wire_round_trip_is_what_the_draft_sampled_from(sparse):
    """The draft samples from check_distribution(q_f32); the target parses the message to the same bits."""
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 1000, generator=generator) * 3
    q32 = logits_to_probs(logits, SamplingParams(temperature=0.8, top_k=50), None).to(torch.float32)
    wire = draft_probs_to_pb(q32, sparse=sparse)
    message = common_pb2.Proposal(token_ids=[1, 2, 3], distributions=wire)
    parsed = common_pb2.Proposal.FromString(message.SerializeToString())
    q = draft_probs_from_pb(parsed.distributions, 1000)
    assert q.dtype == F64 and q.shape == (3, 1000)
    assert torch.equal(q, check_distribution(q32))
    if sparse:
        assert [len(d.sparse.token_ids) for d in wire] == [50, 50, 50]
    else:
        assert [len(d.dense.probs_f32le) for d in wire] == [4000] * 3
    assert draft_probs_from_pb([], 1000).shape == (0, 1000)


def test_dense_from_sparse():
    assert torch.equal(dense_from_sparse([3, 1], [0.25, 0.75], 5), f64([0, 0.75, 0, 0.25, 0]))
    _exact_raises(InvalidArgument, lambda: dense_from_sparse([1, 1], [0.5, 0.5], 5))
    _exact_raises(InvalidArgument, lambda: dense_from_sparse([5], [1.0], 5))
    _exact_raises(InvalidArgument, lambda: dense_from_sparse([0, 1], [1.0], 5))
    _exact_raises(InvalidDistribution, lambda: dense_from_sparse([], [], 5))


def test_wire_errors():
    def dense(values):
        raw = np.asarray(values, dtype="<f4").tobytes()
        return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))

    _exact_raises(VocabularyMismatch, lambda: draft_probs_from_pb([dense([0.5, 0.5])], 3))
    _exact_raises(InvalidDistribution, lambda: draft_probs_from_pb([dense([0.5, float("nan"), 0.5])], 3))
    _exact_raises(InvalidDistribution, lambda: draft_probs_from_pb([dense([0.25, 0.25, 0.0])], 3))
    _exact_raises(InvalidArgument, lambda: draft_probs_from_pb([common_pb2.DraftDistribution()], 3))
    sparse = common_pb2.SparseDistribution(token_ids=[0, 1], probs=[1.0])
    _exact_raises(
        InvalidArgument, lambda: draft_probs_from_pb([common_pb2.DraftDistribution(sparse=sparse)], 3)
    )
    _exact_raises(InvalidArgument, lambda: draft_probs_to_pb(torch.ones(2, 3, dtype=F64) / 3, sparse=False))


def test_emitted():
    assert VerifyOutcome(2, 9, False).emitted((4, 5, 6)) == (4, 5, 9)
    assert VerifyOutcome(0, 1, True).emitted(()) == (1,)
