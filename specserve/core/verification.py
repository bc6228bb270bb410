"""Exact speculative verification: the rejection sampler of speculative decoding, and the coupled rule.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding", ICML 2023 (arXiv:2211.17192), and Chen, Borgeaud, Irving, Lespiau,
Sifre, Jumper, "Accelerating Large Language Model Decoding with Speculative
Sampling" (arXiv:2302.01318); for :func:`verify_coupled`, Daliri, Musco and
Suresh, "Coupling without Communication and Drafter-Invariant Speculative
Decoding" (arXiv:2408.07978, 2024).

Terms, for one session and one round:

* ``q_i`` (draft): the distribution the draft sampled its ``i``-th proposed
  token ``x_i`` from, exactly as shipped (dense, sparse, or a point mass for an
  n-gram proposal or a greedy draft). ``gamma`` = number of proposed tokens.
* ``p_i`` (target): the target's processed distribution at the position of
  ``x_i``, given the committed prefix and ``x_1..x_{i-1}``; ``p_{gamma+1}``
  follows the last proposed token.
* **accepted**: ``x_i`` is kept iff ``u_i < p_i(x_i) / q_i(x_i)`` with ``u_i``
  uniform, i.e. with probability ``min(1, p_i(x_i) / q_i(x_i))``
  (:func:`acceptance_probs`); tokens are tested in order and testing stops at
  the first rejection.
* **correction**: at the first rejection, at index ``i``, a token sampled from
  the residual ``norm(max(0, p_i - q_i))`` (:func:`residual_distribution`)
  replaces ``x_i`` and the round ends.
* **bonus**: when all ``gamma`` tokens are accepted, one more token sampled
  from ``p_{gamma+1}``. ``gamma = 0`` is the plain target step: the "bonus" is
  a sample of ``p_1``.

Whatever ``q`` is, each emitted token is distributed exactly as the target's
``p`` (Leviathan et al., Theorem 1), *provided* the correction comes from the
residual and the ``q`` used in the ratio is the one the draft sampled from.

Randomness (:mod:`specserve.core.rng`): with ``n = positions[b]`` the index in the
sequence of ``x_1``, the acceptance test of ``x_i`` (1-based) uses
``uniform(seed, n + i - 1, ACCEPT)``; the correction at index ``i`` uses
``uniform(seed, n + i - 1, RESAMPLE)``; the bonus uses
``uniform(seed, n + gamma, RESAMPLE)``. Each number is drawn only when needed,
so a row's outcome depends on its seed and position alone, never on its batch.

Impossible branches raise: a proposed token with ``q = 0``
(:class:`~specserve.api.errors.ZeroDraftProbability`), a NaN / negative /
unnormalised row (:class:`~specserve.api.errors.InvalidDistribution`, tolerance
``1e-3`` on the sum as :func:`~specserve.core.sampling.check_distribution`), a
rejection where ``max(0, p - q)`` has no mass
(:class:`~specserve.api.errors.ZeroResidualMass`), bad ids or shapes
(:class:`~specserve.api.errors.InvalidArgument`). Nothing falls back silently.

:func:`verify_batch` is cut into named pure steps, as vLLM's rejection sampler:
:func:`_validate` the batch, :func:`_flatten` the proposed tokens,
:func:`_gather_ratios` (``min(1, p/q)`` of every proposed token),
:func:`_first_rejections`, :func:`_recovered_tokens` (the corrections) and
:func:`_bonus_tokens`.

**Coupled rule** (:func:`verify_coupled`, the ``coupled`` sampling mode): the
target's token at each position is ``y_i = argmax(log p_i + G_i)``, with
``G_i = gumbel_noise(seed, n + i - 1)`` (:func:`specserve.core.rng.gumbel_noise`;
Gumbel-max, an exact sample of ``p_i``). ``x_i`` is **accepted** iff
``x_i == y_i``, in order; at the first mismatch ``y_i`` is the correction; when
every token matches, ``y_{gamma+1}`` is the bonus. The emitted tokens are
always ``y_1, y_2, ...``: target-only Gumbel-max sampling with the same noise,
whatever was proposed, so the output depends on the seed and never on the
draft. ``q`` is not read (a draft that samples ``x_i = argmax(log q_i + G_i)``
with the same noise is accepted with probability at least
``(1 - TV) / (1 + TV)``, against ``1 - TV`` for the rejection sampler; TV is
the total-variation distance between ``p_i`` and ``q_i``).

This module is pure maths: no gRPC, Redis or logging. It never imports a
proposer; a proposal arrives as a :class:`~specserve.core.proposal.DraftProposal`
(its wire codec is :mod:`specserve.core.proposal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.api.errors import (
    InvalidArgument,
    InvalidDistribution,
    VocabularyMismatch,
    ZeroDraftProbability,
    ZeroResidualMass,
)
from specserve.core.proposal import DraftProposal
from specserve.core.rng import Purpose, gumbel_noise, uniform
from specserve.core.sampling import gumbel_argmax, sample_rows

#: Tolerance on the sum of a probability row (as :func:`check_distribution`'s default).
_SUM_ATOL = 1e-3


@dataclass(frozen=True)
class VerifyOutcome:
    """One session's verdict: ``accepted`` draft tokens, then ``next_token``."""

    accepted: int  # draft tokens accepted, 0..gamma
    next_token: int  # the correction (after a rejection) or the bonus (all accepted)
    bonus: bool  # True when all gamma tokens were accepted (also for gamma = 0)

    def emitted(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens this round adds: the accepted prefix of ``token_ids``, then ``next_token``."""
        return (*tuple(token_ids[: self.accepted]), self.next_token)


def acceptance_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``min(1, p / q)`` elementwise: ``[...]`` x ``[...]`` -> ``[...]`` float64.

    The probability of accepting a proposed token. Where ``q == 0`` the value is
    1 by convention (such a token can never be proposed; proposing it raises
    :class:`~specserve.api.errors.ZeroDraftProbability` in the verifier).
    """
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    ratio = p64 / torch.where(q64 > 0, q64, torch.ones_like(q64))
    return torch.where(q64 > 0, ratio.clamp(max=1.0), torch.ones_like(ratio))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``: ``[..., vocab]`` x ``[..., vocab]`` -> ``[..., vocab]`` float64.

    The distribution of the correction token. Raises
    :class:`~specserve.api.errors.ZeroResidualMass` when a row has no mass (only
    possible at a rejection if ``q`` is not the distribution the token came from).
    """
    residual = (p.to(torch.float64) - q.to(torch.float64)).clamp(min=0.0)  # [..., vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    if not bool(torch.isfinite(mass).all()):
        raise InvalidDistribution("residual max(0, p - q) is not finite")
    if not bool((mass > 0).all()):
        raise ZeroResidualMass(
            "rejection where max(0, p - q) has zero mass: q is not what the token came from"
        )
    return residual / mass


def verify_batch(
    target_probs: torch.Tensor,
    proposals: Sequence[DraftProposal],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[VerifyOutcome]:
    """Verify a ragged batch of proposals against the target (see the module docstring).

    ``target_probs``: ``[batch, max_gamma + 1, vocab]`` float64; row ``b`` uses
    its first ``len(proposals[b]) + 1`` positions, the rest is padding and never
    read. ``seeds[b]``: the session seed; ``positions[b]``: the index in the
    session's sequence of ``proposals[b]``'s first token (of the sampled token
    when the proposal is empty).

    The gathers, checks and samples are batched; only the scalar acceptance
    tests run per token, each drawing its uniform when (and only if) it is needed.
    """
    p, gammas = _validate(target_probs, proposals, seeds, positions)  # p: [batch, max_gamma + 1, vocab]
    if not gammas:
        return []
    drafted = _flatten(proposals, p.device)
    ratios = _gather_ratios(p, drafted)  # [tokens]
    stops = _first_rejections(ratios, drafted.offsets, gammas, seeds, positions)  # [batch]
    next_token = _recovered_tokens(p, drafted, stops, gammas, seeds, positions)
    next_token.update(_bonus_tokens(p, stops, gammas, seeds, positions))
    return [
        VerifyOutcome(accepted=stop, next_token=next_token[b], bonus=stop == gammas[b])
        for b, stop in enumerate(stops)
    ]


@dataclass(frozen=True, eq=False)
class _Drafted:
    """Every proposed token of a batch, flattened in row order (``tokens`` of them)."""

    rows: list[int]  # [tokens]: the batch row b of each token
    index: list[int]  # [tokens]: its index i within its proposal
    token: list[int]  # [tokens]: the token x
    q_row: list[int]  # [tokens]: its distribution's row in ``q``; -1 for a point mass (q(x) = 1)
    q: torch.Tensor | None  # [q_rows, vocab] float64: every shipped q row, checked
    offsets: list[int]  # [batch + 1]: row b's tokens are [offsets[b], offsets[b + 1])


def _validate(
    target_probs: torch.Tensor,
    proposals: Sequence[DraftProposal],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> tuple[torch.Tensor, list[int]]:
    """Check shapes, ids and the target rows; returns ``p`` ``[batch, max_gamma + 1, vocab]`` float64 and the gammas."""
    if target_probs.dim() != 3:
        raise InvalidArgument(
            f"target_probs must be [batch, gamma+1, vocab], got {tuple(target_probs.shape)}"
        )
    batch, rows, vocab_size = target_probs.shape
    if not (len(proposals) == len(seeds) == len(positions) == batch):
        raise InvalidArgument(
            f"batch sizes differ: target_probs {batch}, proposals {len(proposals)}, "
            f"seeds {len(seeds)}, positions {len(positions)}"
        )
    gammas = [proposal.gamma for proposal in proposals]
    for b, proposal in enumerate(proposals):
        if gammas[b] + 1 > rows:
            raise InvalidArgument(f"row {b}: {gammas[b]} proposed tokens need {gammas[b] + 1} target rows")
        if positions[b] < 0:
            raise InvalidArgument(f"row {b}: position must be >= 0, got {positions[b]}")
        if any(t >= vocab_size for t in proposal.token_ids):
            raise InvalidArgument(f"row {b}: token ids must be < vocab size {vocab_size}")
        if proposal.probs is not None and proposal.probs.shape[-1] != vocab_size:
            raise VocabularyMismatch(
                f"row {b}: draft distributions have {proposal.probs.shape[-1]} entries, target {vocab_size}"
            )
    p = target_probs.to(torch.float64)  # [batch, max_gamma + 1, vocab]
    if batch:
        used = torch.arange(rows, device=p.device)[None, :] <= torch.tensor(gammas, device=p.device)[:, None]
        _require_distributions(p, used, "target")  # [batch, max_gamma + 1] used; p is used as given
    return p, gammas


def _flatten(proposals: Sequence[DraftProposal], device: torch.device) -> _Drafted:
    """Every proposed token with its row, index and q row; the shipped q rows, checked as distributions."""
    rows: list[int] = []
    index: list[int] = []
    token: list[int] = []
    q_row: list[int] = []
    q_parts: list[torch.Tensor] = []
    q_rows = 0
    offsets = [0]
    for b, proposal in enumerate(proposals):
        gamma = proposal.gamma
        rows += [b] * gamma
        index += range(gamma)
        token += proposal.token_ids
        if proposal.probs is None or gamma == 0:
            q_row += [-1] * gamma
        else:
            q_row += range(q_rows, q_rows + gamma)
            q_rows += gamma
            q_parts.append(proposal.probs)  # [gamma, vocab]
        offsets.append(offsets[-1] + gamma)
    q = None
    if q_parts:
        q = torch.cat(q_parts).to(device=device, dtype=torch.float64)  # [q_rows, vocab]
        _require_distributions(q, None, "draft")
    return _Drafted(rows=rows, index=index, token=token, q_row=q_row, q=q, offsets=offsets)


def _gather_ratios(p: torch.Tensor, drafted: _Drafted) -> list[float]:
    """``min(1, p_i(x_i) / q_i(x_i))`` of every proposed token: ``[tokens]``.

    Raises :class:`~specserve.api.errors.ZeroDraftProbability` for a token its own q gives probability 0.
    """
    if not drafted.token:
        return []
    device = p.device
    x = _index(drafted.token, device)  # [tokens]
    p_x = p[_index(drafted.rows, device), _index(drafted.index, device), x]  # [tokens]
    q_x = torch.ones_like(p_x)  # [tokens]: 1 for a point mass
    if drafted.q is not None:
        has_q = _index([k for k, r in enumerate(drafted.q_row) if r >= 0], device)  # [with q]
        q_x[has_q] = drafted.q[_index([r for r in drafted.q_row if r >= 0], device), x[has_q]]
        zero = torch.nonzero(q_x <= 0).reshape(-1)
        if zero.numel():
            k = int(zero[0])
            raise ZeroDraftProbability(
                f"row {drafted.rows[k]}: proposed token {drafted.token[k]} at index {drafted.index[k]} "
                "has draft probability 0"
            )
    return acceptance_probs(p_x, q_x).tolist()


def _first_rejections(
    ratios: Sequence[float],
    offsets: Sequence[int],
    gammas: Sequence[int],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """Per row ``[batch]``: the index of the first rejected token, or gamma when all are accepted.

    The test of token ``i`` of row ``b`` draws ``uniform(seed, position + i, ACCEPT)``, only if reached.
    """
    stops: list[int] = []
    for b, gamma in enumerate(gammas):
        seed, position, stop = int(seeds[b]), int(positions[b]), gamma
        for i in range(gamma):
            if not uniform(seed, position + i, Purpose.ACCEPT) < ratios[offsets[b] + i]:
                stop = i
                break
        stops.append(stop)
    return stops


def _recovered_tokens(
    p: torch.Tensor,
    drafted: _Drafted,
    stops: Sequence[int],
    gammas: Sequence[int],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> dict[int, int]:
    """The correction of each row with a rejection: ``{row: token}`` sampled from ``norm(max(0, p - q))``."""
    rejected = [b for b, stop in enumerate(stops) if stop < gammas[b]]
    if not rejected:
        return {}
    device = p.device
    flat = [drafted.offsets[b] + stops[b] for b in rejected]  # [rejected]: the rejected tokens
    p_rej = p[_index(rejected, device), _index([stops[b] for b in rejected], device)]  # [rejected, vocab]
    q_rej = torch.zeros_like(p_rej)  # [rejected, vocab]
    q_rej[torch.arange(len(rejected), device=device), _index([drafted.token[k] for k in flat], device)] = 1.0
    with_q = [j for j, k in enumerate(flat) if drafted.q_row[k] >= 0]  # rows whose q was shipped
    if with_q and drafted.q is not None:
        q_rej[_index(with_q, device)] = drafted.q[_index([drafted.q_row[flat[j]] for j in with_q], device)]
    residual = residual_distribution(p_rej, q_rej)  # [rejected, vocab]
    us = [uniform(int(seeds[b]), int(positions[b]) + stops[b], Purpose.RESAMPLE) for b in rejected]
    return dict(zip(rejected, sample_rows(residual, us), strict=True))


def _bonus_tokens(
    p: torch.Tensor,
    stops: Sequence[int],
    gammas: Sequence[int],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> dict[int, int]:
    """The bonus of each row that accepted every token: ``{row: token}`` sampled from ``p_{gamma+1}``."""
    completed = [b for b, stop in enumerate(stops) if stop == gammas[b]]
    if not completed:
        return {}
    device = p.device
    p_bonus = p[
        _index(completed, device), _index([gammas[b] for b in completed], device)
    ]  # [completed, vocab]
    us = [uniform(int(seeds[b]), int(positions[b]) + gammas[b], Purpose.RESAMPLE) for b in completed]
    return dict(zip(completed, sample_rows(p_bonus, us), strict=True))


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)  # [len(values)]


def _require_distributions(probs: torch.Tensor, used: torch.Tensor | None, what: str) -> None:
    """Raise :class:`InvalidDistribution` unless every used row of ``[..., vocab]`` is a distribution.

    A distribution here: finite, non-negative, summing to 1 within ``1e-3`` (the
    tolerance of :func:`~specserve.core.sampling.check_distribution`). ``used``
    (``[...]`` bool) masks out padding rows.
    """
    # Two reductions decide all three: a NaN or an infinity makes the row's sum NaN or infinite (never
    # within the tolerance of 1), and a negative entry (-inf included) makes its minimum negative.
    ok = ((probs.sum(dim=-1) - 1.0).abs() <= _SUM_ATOL) & (probs.amin(dim=-1) >= 0)  # [...]
    bad = ~ok if used is None else used & ~ok
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise InvalidDistribution(
            f"{what} row {where} is not a distribution (NaN/inf, negative, or sum off 1 by > {_SUM_ATOL})"
        )


def verify_greedy(target_argmax: torch.Tensor, proposals: Sequence[DraftProposal]) -> list[VerifyOutcome]:
    """Greedy verification: accept while ``x_i`` equals the target argmax; emit the argmax.

    ``target_argmax``: ``[batch, max_gamma + 1]`` int64. At the first mismatch
    the target's argmax is the correction; if all match, the argmax after the
    last proposed token is the bonus. Needs no randomness.
    """
    if target_argmax.dim() != 2 or target_argmax.shape[0] != len(proposals):
        raise InvalidArgument(
            f"target_argmax must be [batch={len(proposals)}, gamma+1], got {tuple(target_argmax.shape)}"
        )
    table = target_argmax.tolist()
    outcomes: list[VerifyOutcome] = []
    for row, proposal in zip(table, proposals, strict=True):
        if proposal.gamma + 1 > len(row):
            raise InvalidArgument(
                f"proposal of {proposal.gamma} tokens needs {proposal.gamma + 1} argmax entries"
            )
        accepted = next(
            (i for i, token in enumerate(proposal.token_ids) if token != row[i]),
            proposal.gamma,
        )
        outcomes.append(
            VerifyOutcome(accepted=accepted, next_token=int(row[accepted]), bonus=accepted == proposal.gamma)
        )
    return outcomes


def verify_coupled(
    target_probs: torch.Tensor,
    proposals: Sequence[DraftProposal],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[VerifyOutcome]:
    """The coupled rule (see the module docstring): accept while ``x_i == argmax(log p_i + G_i)``.

    Arguments as :func:`verify_batch`; ``target_probs`` may live on any device
    (the noise is drawn there, only the ``[batch, max_gamma + 1]`` winners come
    back). Proposals' distributions, if any, are ignored. Row ``b`` draws the
    noise of its positions ``positions[b] .. positions[b] + gamma_b`` and no other.
    """
    p, gammas = _validate(target_probs, proposals, seeds, positions)  # p: [batch, max_gamma + 1, vocab]
    if not gammas:
        return []
    rows = [b for b, gamma in enumerate(gammas) for _ in range(gamma + 1)]  # [positions]
    steps = [i for gamma in gammas for i in range(gamma + 1)]  # [positions]
    noise = gumbel_noise(
        [int(seeds[b]) for b in rows],
        [int(positions[b]) + i for b, i in zip(rows, steps, strict=True)],
        p.shape[-1],
        device=p.device,
    )  # [positions, vocab]
    winners = gumbel_argmax(p[_index(rows, p.device), _index(steps, p.device)], noise)  # [positions]
    target_tokens = torch.full((len(gammas), p.shape[1]), -1, dtype=torch.int64)  # [batch, max_gamma + 1]
    target_tokens[torch.tensor(rows), torch.tensor(steps)] = winners.cpu()
    return verify_greedy(target_tokens, proposals)
