"""Exact speculative verification: the rejection sampler of speculative decoding.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding", ICML 2023 (arXiv:2211.17192), and Chen, Borgeaud, Irving, Lespiau,
Sifre, Jumper, "Accelerating Large Language Model Decoding with Speculative
Sampling" (arXiv:2302.01318).

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

Randomness (:mod:`specserve.rng`): with ``n = positions[b]`` the index in the
sequence of ``x_1``, the acceptance test of ``x_i`` (1-based) uses
``uniform(seed, n + i - 1, ACCEPT)``; the correction at index ``i`` uses
``uniform(seed, n + i - 1, RESAMPLE)``; the bonus uses
``uniform(seed, n + gamma, RESAMPLE)``. Each number is drawn only when needed,
so a row's outcome depends on its seed and position alone, never on its batch.

Impossible branches raise: a proposed token with ``q = 0``
(:class:`~specserve.errors.ZeroDraftProbability`), a NaN / negative /
unnormalised row (:class:`~specserve.errors.InvalidDistribution`, tolerance
``1e-3`` on the sum as :func:`~specserve.sampling.check_distribution`), a
rejection where ``max(0, p - q)`` has no mass
(:class:`~specserve.errors.ZeroResidualMass`), bad ids or shapes
(:class:`~specserve.errors.InvalidArgument`). Nothing falls back silently.

This module is pure maths: no gRPC calls, Redis or logging (the protobuf
helpers at the end only convert messages). It never imports a proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.errors import (
    InvalidArgument,
    InvalidDistribution,
    VocabularyMismatch,
    ZeroDraftProbability,
    ZeroResidualMass,
)
from specserve.rng import Purpose, uniform
from specserve.sampling import check_distribution, sample_rows
from specserve.v1 import common_pb2

#: Tolerance on the sum of a probability row (as :func:`check_distribution`'s default).
_SUM_ATOL = 1e-3


@dataclass(frozen=True, eq=False)
class DraftProposal:
    """Tokens a proposer drafted and the distributions they were sampled from.

    ``probs`` is ``[gamma, vocab]`` float64, row ``i`` the exact ``q_i`` that
    ``token_ids[i]`` was sampled from; ``None`` means a point mass on each
    token (n-gram proposals, greedy drafts).
    """

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None  # [gamma, vocab] float64

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if any(t < 0 for t in self.token_ids):
            raise InvalidArgument(f"token ids must be >= 0, got {self.token_ids}")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise InvalidArgument(
                f"probs must be [gamma={len(self.token_ids)}, vocab], got {tuple(self.probs.shape)}"
            )

    @property
    def gamma(self) -> int:
        return len(self.token_ids)


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
    :class:`~specserve.errors.ZeroDraftProbability` in the verifier).
    """
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    ratio = p64 / torch.where(q64 > 0, q64, torch.ones_like(q64))
    return torch.where(q64 > 0, ratio.clamp(max=1.0), torch.ones_like(ratio))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``: ``[..., vocab]`` x ``[..., vocab]`` -> ``[..., vocab]`` float64.

    The distribution of the correction token. Raises
    :class:`~specserve.errors.ZeroResidualMass` when a row has no mass (only
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
    if batch == 0:
        return []
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
    p = target_probs.to(torch.float64)  # [batch, max_gamma+1, vocab]
    device = p.device
    used = torch.arange(rows, device=device)[None, :] <= torch.tensor(gammas, device=device)[:, None]
    _require_distributions(p, used, "target")  # p is used as given, not renormalised

    # Every proposed token, flattened: row b, index i, token x, and its q row in
    # q_all (-1 for a point mass, where q(x) = 1).
    flat_b: list[int] = []
    flat_i: list[int] = []
    flat_x: list[int] = []
    flat_q: list[int] = []
    q_parts: list[torch.Tensor] = []
    q_rows = 0
    offsets = [0]
    for b, proposal in enumerate(proposals):
        flat_b += [b] * gammas[b]
        flat_i += range(gammas[b])
        flat_x += proposal.token_ids
        if proposal.probs is None or gammas[b] == 0:
            flat_q += [-1] * gammas[b]
        else:
            flat_q += range(q_rows, q_rows + gammas[b])
            q_rows += gammas[b]
            q_parts.append(proposal.probs)
        offsets.append(offsets[-1] + gammas[b])
    q_all = None
    if q_parts:
        q_all = torch.cat(q_parts).to(device=device, dtype=torch.float64)  # [q_rows, vocab]
        _require_distributions(q_all, None, "draft")

    ratios: list[float] = []
    if flat_x:
        x = _index(flat_x, device)  # [tokens]
        p_x = p[_index(flat_b, device), _index(flat_i, device), x]  # [tokens]
        q_x = torch.ones_like(p_x)  # [tokens]
        if q_all is not None:
            has_q = _index([k for k, r in enumerate(flat_q) if r >= 0], device)
            q_x[has_q] = q_all[_index([r for r in flat_q if r >= 0], device), x[has_q]]
            zero = torch.nonzero(q_x <= 0).reshape(-1)
            if zero.numel():
                k = int(zero[0])
                raise ZeroDraftProbability(
                    f"row {flat_b[k]}: proposed token {flat_x[k]} at index {flat_i[k]} has draft probability 0"
                )
        ratios = acceptance_probs(p_x, q_x).tolist()

    stops: list[int] = []  # per row: index of the first rejection, or gamma when all are accepted
    for b in range(batch):
        seed, position, stop = int(seeds[b]), int(positions[b]), gammas[b]
        for i in range(gammas[b]):
            if not uniform(seed, position + i, Purpose.ACCEPT) < ratios[offsets[b] + i]:
                stop = i
                break
        stops.append(stop)

    next_token: dict[int, int] = {}
    rejected = [b for b in range(batch) if stops[b] < gammas[b]]
    if rejected:
        flat = [offsets[b] + stops[b] for b in rejected]  # the rejected tokens
        index = torch.arange(len(rejected), device=device)  # [rejected]
        p_rej = p[_index(rejected, device), _index([stops[b] for b in rejected], device)]  # [rejected, vocab]
        q_rej = torch.zeros_like(p_rej)  # [rejected, vocab]
        q_rej[index, _index([flat_x[k] for k in flat], device)] = 1.0  # point masses
        with_q = [j for j, k in enumerate(flat) if flat_q[k] >= 0]
        if with_q and q_all is not None:
            q_rej[_index(with_q, device)] = q_all[_index([flat_q[flat[j]] for j in with_q], device)]
        residual = residual_distribution(p_rej, q_rej)  # [rejected, vocab]
        us = [uniform(int(seeds[b]), int(positions[b]) + stops[b], Purpose.RESAMPLE) for b in rejected]
        next_token.update(zip(rejected, sample_rows(residual, us), strict=True))
    completed = [b for b in range(batch) if stops[b] == gammas[b]]
    if completed:
        p_bonus = p[_index(completed, device), _index([gammas[b] for b in completed], device)]
        us = [uniform(int(seeds[b]), int(positions[b]) + gammas[b], Purpose.RESAMPLE) for b in completed]
        next_token.update(zip(completed, sample_rows(p_bonus, us), strict=True))
    return [
        VerifyOutcome(accepted=stops[b], next_token=next_token[b], bonus=stops[b] == gammas[b])
        for b in range(batch)
    ]


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)  # [len(values)]


def _require_distributions(probs: torch.Tensor, used: torch.Tensor | None, what: str) -> None:
    """Raise :class:`InvalidDistribution` unless every used row of ``[..., vocab]`` is a distribution.

    A distribution here: finite, non-negative, summing to 1 within ``1e-3`` (the
    tolerance of :func:`~specserve.sampling.check_distribution`). ``used``
    (``[...]`` bool) masks out padding rows.
    """
    ok = torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1)  # [...]
    ok &= (probs.sum(dim=-1) - 1.0).abs() <= _SUM_ATOL
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


def dense_from_sparse(
    ids: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """A sparse support ``(ids, probs)`` as a dense ``[vocab]`` float64 row; every other token is 0.

    Checks the ids (distinct, in range) and the lengths; the values are checked
    by :func:`~specserve.sampling.check_distribution` afterwards.
    """
    index = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)  # [support]
    values = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)  # [support]
    if index.shape != values.shape:
        raise InvalidArgument(f"sparse support has {index.numel()} ids but {values.numel()} probabilities")
    if index.numel() == 0:
        raise InvalidDistribution("sparse distribution with an empty support")
    if int(index.min()) < 0 or int(index.max()) >= vocab_size:
        raise InvalidArgument(f"sparse token ids must be in [0, {vocab_size})")
    if torch.unique(index).numel() != index.numel():
        raise InvalidArgument("sparse token ids must be distinct")
    dense = torch.zeros(vocab_size, dtype=torch.float64)  # [vocab]
    dense[index] = values
    return dense


def draft_probs_from_pb(
    distributions: Sequence[common_pb2.DraftDistribution], vocab_size: int
) -> torch.Tensor:
    """Wire distributions -> ``[gamma, vocab]`` float64 through :func:`check_distribution`.

    Dense rows are little-endian float32 bytes of exactly ``vocab_size``
    entries; sparse rows list their support. The result is bitwise what the draft
    sampled from when it called ``check_distribution`` on its float32 vector.
    """
    rows: list[torch.Tensor] = []
    for i, dist in enumerate(distributions):
        kind = dist.WhichOneof("support")
        if kind == "dense":
            raw = dist.dense.probs_f32le
            if len(raw) != 4 * vocab_size:
                raise VocabularyMismatch(
                    f"dense distribution {i} has {len(raw)} bytes, expected 4 * vocab_size = {4 * vocab_size}"
                )
            rows.append(torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float64)))
        elif kind == "sparse":
            rows.append(dense_from_sparse(list(dist.sparse.token_ids), list(dist.sparse.probs), vocab_size))
        else:
            raise InvalidArgument(f"draft distribution {i} has neither a dense nor a sparse support")
    if not rows:
        return torch.zeros((0, vocab_size), dtype=torch.float64)
    return check_distribution(torch.stack(rows))  # [gamma, vocab] float64


def draft_probs_to_pb(probs_f32: torch.Tensor, sparse: bool) -> list[common_pb2.DraftDistribution]:
    """``[gamma, vocab]`` float32 -> wire distributions (dense bytes, or the non-zero support).

    The draft samples from ``check_distribution(probs_f32)``; the target
    rebuilds exactly that tensor with :func:`draft_probs_from_pb`.
    """
    if probs_f32.dim() != 2 or probs_f32.dtype != torch.float32:
        raise InvalidArgument(
            f"draft probs must be [gamma, vocab] float32, got {tuple(probs_f32.shape)} {probs_f32.dtype}"
        )
    host = probs_f32.detach().to("cpu").contiguous()  # [gamma, vocab]
    out: list[common_pb2.DraftDistribution] = []
    for row in host:
        if sparse:
            support = torch.nonzero(row).reshape(-1)  # [support]
            out.append(
                common_pb2.DraftDistribution(
                    sparse=common_pb2.SparseDistribution(
                        token_ids=support.tolist(), probs=row[support].tolist()
                    )
                )
            )
        else:
            raw = row.numpy().astype("<f4", copy=False).tobytes()
            out.append(common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw)))
    return out
