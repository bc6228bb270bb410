"""Logits processing and sampling, as pure tensor functions.

The processing is Hugging Face ``generate()``'s, done by its own
``LogitsProcessor`` classes in the order ``GenerationMixin._get_logits_processor``
applies them (transformers 5.24)::

    RepetitionPenaltyLogitsProcessor   (greedy and sampling; skipped when penalty == 1)
    TemperatureLogitsWarper            (sampling only; skipped when temperature == 1)
    TopKLogitsWarper                   (sampling only; skipped when top_k == 0)
    TopPLogitsWarper                   (sampling only; skipped when top_p == 1)
    MinPLogitsWarper                   (sampling only; skipped when min_p == 0, where it is a no-op)

with ``min_tokens_to_keep=1`` (HF's value for ``num_beams=1``), on logits cast
to float32 as ``generate()`` casts them. Greedy (``temperature == 0``) is
``do_sample=False``: only the repetition penalty applies, then argmax.
The draft and the target both call these functions, so a target verifying a
proposal sees exactly the distribution it would sample from alone.

Probabilities leave this module as float64: :func:`logits_to_probs` takes the
softmax in float64 of the processed float32 logits (removed tokens get exactly
0), and :func:`check_distribution` is the one gate every externally supplied
distribution passes through. :func:`processed_logprobs` gives the log of the
processed distribution that a request's logprobs report (for greedy decoding:
the repetition penalty, then the softmax at temperature 1), and
:func:`pick_logprobs` the emitted tokens' entries with their top alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specserve.api.errors import InvalidArgument, InvalidDistribution
from specserve.api.params import PositionLogprobs, SamplingParams, TokenLogprob

Context = Sequence[Sequence[int]] | torch.Tensor | None


def _processors(params: SamplingParams) -> LogitsProcessorList:
    """The warpers HF ``generate()`` would build for ``params``, in its order (penalty aside)."""
    warpers = LogitsProcessorList()
    if params.greedy:
        return warpers
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=int(params.top_k), min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(params.top_p), min_tokens_to_keep=1))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p=float(params.min_p), min_tokens_to_keep=1))
    return warpers


def _context_ids(context: Context, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Ragged token contexts -> ``[rows, max_len]`` int64, padded with ``vocab_size``.

    HF's repetition penalty clamps ids to ``vocab_size`` into a padding column it
    drops, so padding with ``vocab_size`` penalises nothing.
    """
    if context is None:
        raise InvalidArgument("repetition_penalty != 1 needs the context (token ids before each row)")
    if isinstance(context, torch.Tensor):
        if context.dim() != 2 or context.shape[0] != rows:
            raise InvalidArgument(f"context must be [{rows}, len], got {tuple(context.shape)}")
        ids = context.to(device=device, dtype=torch.int64)  # [rows, len]
        valid = ids
    else:
        if len(context) != rows:
            raise InvalidArgument(f"context has {len(context)} sequences for {rows} rows of logits")
        width = max((len(seq) for seq in context), default=0)
        ids = torch.full((rows, max(width, 1)), vocab_size, dtype=torch.int64)  # [rows, max_len]
        for row, seq in enumerate(context):
            if len(seq):
                ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.int64)
        valid = torch.as_tensor([t for seq in context for t in seq], dtype=torch.int64)
        ids = ids.to(device)
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        raise InvalidArgument(f"context token ids must be in [0, {vocab_size})")
    return ids  # [rows, max_len]


def process_logits(logits: torch.Tensor, params: SamplingParams, context: Context) -> torch.Tensor:
    """Apply ``params``' processing to ``logits``, exactly as HF ``generate()`` does.

    ``logits``: ``[N, vocab]`` any float dtype. ``context``: the token ids that
    precede each row (``N`` sequences, ragged allowed, or an ``[N, len]`` tensor);
    only read when ``repetition_penalty != 1`` (may be ``None`` otherwise).
    Returns ``[N, vocab]`` float32, removed tokens ``-inf``.
    """
    if logits.dim() != 2:
        raise InvalidArgument(f"logits must be [N, vocab], got {tuple(logits.shape)}")
    rows, vocab_size = logits.shape
    scores = logits.to(dtype=torch.float32, copy=True)  # [N, vocab]
    if params.repetition_penalty != 1.0:
        ids = _context_ids(context, rows, vocab_size, scores.device)  # [N, max_len]
        penalty = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))
        scores = penalty(ids, scores)
    warpers = _processors(params)
    if len(warpers):
        # The warpers never read input_ids; HF passes the sequence, we pass an empty one.
        no_ids = cast(torch.LongTensor, torch.zeros((rows, 0), dtype=torch.int64, device=scores.device))
        scores = warpers(no_ids, scores)
    return scores  # [N, vocab] float32


def suppress_tokens(logits: torch.Tensor, token_ids: frozenset[int] | Sequence[int], rows: int) -> torch.Tensor:
    """``logits`` with ``token_ids`` removed (``-inf``) from its first ``rows`` rows: ``[N, vocab]`` -> ``[N, vocab]``.

    ``min_new_tokens`` (vLLM's ``min_tokens``): a row whose token would be generated before the
    minimum cannot emit a stop token, as Hugging Face's ``MinNewTokensLengthLogitsProcessor`` masks
    EOS (it runs before the warpers, so the masked row is then processed as any other). Returns
    ``logits`` itself when there is nothing to mask, else a copy; ids outside the vocabulary are
    skipped (a draft's vocabulary may be smaller than the target's).
    """
    if rows <= 0 or not token_ids:
        return logits
    vocab_size = logits.shape[-1]
    ids = sorted(t for t in token_ids if 0 <= t < vocab_size)
    if not ids:
        return logits
    out = logits.clone()  # [N, vocab]
    out[:rows, torch.as_tensor(ids, dtype=torch.int64, device=logits.device)] = float("-inf")
    return out  # [N, vocab]


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, context: Context) -> torch.Tensor:
    """The distribution each row is sampled from: ``[N, vocab]`` -> ``[N, vocab]`` float64.

    Sampling: softmax (in float64) of :func:`process_logits`. Greedy
    (``temperature == 0``): one-hot at the argmax of the processed logits, the
    lowest token id on ties (``torch.argmax``, as HF greedy decoding).

    Raises :class:`~specserve.api.errors.InvalidDistribution` when a row of the
    processed logits holds NaN or +inf, or removes every token: such a row has
    no distribution, and a NaN argmax or softmax must never be sampled from.
    """
    scores = process_logits(logits, params, context)  # [N, vocab] float32
    if params.greedy:
        probs = torch.zeros(scores.shape, dtype=torch.float64, device=scores.device)  # [N, vocab]
        probs.scatter_(-1, greedy_tokens(scores).unsqueeze(-1), 1.0)
        return probs
    require_finite_logits(scores)
    return torch.softmax(scores.to(torch.float64), dim=-1)  # [N, vocab] float64


def require_finite_logits(scores: torch.Tensor) -> None:
    """Raise :class:`InvalidDistribution` unless every row of ``scores`` ``[N, vocab]`` has a distribution.

    A row has one when it holds no NaN and no +inf (``-inf`` marks a removed
    token) and keeps at least one token. The message names the first bad row.
    """
    greedy_tokens(scores)


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax ``[N]`` (the first index of the largest score, as ``argmax``), after
    :func:`require_finite_logits`'s check.

    One reduction does both: a row's maximum is NaN when the row holds a NaN
    (``max`` propagates it), ``+inf`` when it holds ``+inf``, ``-inf`` when every
    token is removed, and finite exactly when the row has a distribution. That is
    one pass over the vocabulary where the check and the argmax took four, which
    matters on a plain greedy verify of one position (every round at gamma = 0).
    """
    if scores.numel() == 0:
        return torch.empty(scores.shape[:-1], dtype=torch.int64, device=scores.device)
    best, tokens = scores.max(dim=-1)  # [N], [N]
    bad = ~torch.isfinite(best)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise InvalidDistribution(
            f"the processed logits of row {row} are NaN or infinite, so there is no distribution to sample "
            "from (the model's output or the sampling settings: temperature, repetition_penalty)"
        )
    return tokens


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token from ``probs`` (``[vocab]`` float64, normalised).

    Returns the first token whose cumulative mass exceeds ``u * total``; a token
    of probability 0 is never returned (its cumulative mass equals its
    predecessor's). ``u`` must be in ``[0, 1)``. One row of :func:`sample_rows`.
    """
    if probs.dim() != 1:
        raise InvalidArgument(f"sample_from takes one row [vocab], got {tuple(probs.shape)}")
    return sample_rows(probs.unsqueeze(0), [u])[0]


def sample_rows(probs: torch.Tensor, us: Sequence[float]) -> list[int]:
    """:func:`sample_from` for each row: ``probs`` ``[R, vocab]``, ``us`` ``R`` uniforms in ``[0, 1)``.

    Each row's result depends only on that row and its uniform (the cumulative
    sum runs sequentially along each row), never on the other rows.
    """
    if probs.dim() != 2 or probs.shape[0] != len(us):
        raise InvalidArgument(f"probs must be [{len(us)}, vocab], got {tuple(probs.shape)}")
    if not all(0.0 <= u < 1.0 for u in us):
        raise InvalidArgument(f"uniforms must be in [0, 1), got {list(us)}")
    if probs.shape[0] == 0:
        return []
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [R, vocab]
    total = cdf[:, -1:]  # [R, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise InvalidDistribution("cannot sample from a row of zero, NaN or infinite total mass")
    target = torch.tensor(us, dtype=torch.float64, device=cdf.device).unsqueeze(-1) * total  # [R, 1]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [R]
    vocab_size = probs.shape[-1]
    # Defensive: u * total < total in IEEE round-to-nearest, so this never fires; if a backend
    # rounded up to the total, take the last positive-mass token rather than run off the end.
    overflow = index >= vocab_size
    if bool(overflow.any()):
        last_positive = vocab_size - 1 - torch.flip(probs > 0, dims=[-1]).to(torch.int8).argmax(dim=-1)  # [R]
        index = torch.where(overflow, last_positive, index)
    return index.tolist()


def gumbel_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling: ``argmax(log probs + noise)`` per row, ``[..., vocab]`` x ``[..., vocab]`` -> ``[...]`` int64.

    With ``noise`` i.i.d. Gumbel(0, 1) the result is an exact sample of
    ``probs`` (Gumbel 1954; the "Gumbel-max trick"); with the same noise two
    distributions give the coupled samples of the coupled sampling mode
    (:func:`specserve.core.rng.gumbel_noise`, docs/design.md "Two sampling modes").
    A token of probability 0 has ``log 0 = -inf`` and never wins. Computed in
    float64. Raises :class:`~specserve.api.errors.InvalidDistribution` for a row
    with no finite winner (all zero, or NaN).
    """
    if probs.shape != noise.shape or probs.dim() == 0:
        raise InvalidArgument(
            f"probs and noise must have the same [..., vocab] shape, got {tuple(probs.shape)} and {tuple(noise.shape)}"
        )
    scores = probs.to(torch.float64).log()  # [..., vocab]; -inf where the probability is 0
    scores += noise.to(device=scores.device, dtype=torch.float64)
    best, winner = scores.max(dim=-1)  # [...], [...]
    if not bool(torch.isfinite(best).all()):
        raise InvalidDistribution("Gumbel-max over a row with no finite score (all zero or NaN)")
    return winner  # [...] int64


def check_distribution(probs: torch.Tensor, *, atol: float = 1e-3) -> torch.Tensor:
    """Validate ``[..., vocab]`` probabilities and return them as float64, renormalised.

    Raises :class:`~specserve.api.errors.InvalidDistribution` on NaN, infinite or
    negative entries, or a row whose sum is off 1 by more than ``atol``.

    The row sums are numpy's pairwise sums of C-contiguous float64 rows, which
    do not depend on how many rows are passed or on threading (torch's
    reductions do), so the draft and the target renormalise the same float32
    vector to the same bits.
    """
    if probs.dim() == 0 or probs.shape[-1] == 0:
        raise InvalidDistribution(f"a distribution needs a vocab dimension, got shape {tuple(probs.shape)}")
    p = probs.detach().to(torch.float64)  # [..., vocab]
    if p.numel() == 0:
        return p.clone()
    host = np.ascontiguousarray(p.cpu().numpy())  # [..., vocab]
    with np.errstate(invalid="ignore"):  # inf - inf in a bad row: NaN, which the check below reports
        total = np.add.reduce(host, axis=-1, keepdims=True)  # [..., 1]
    # A NaN or an infinity makes its row's total NaN or infinite, a negative entry (-inf included) the
    # minimum negative: two reductions clear a valid vector, and only a bad one pays for the diagnosis.
    if not (np.isfinite(total).all() and host.min() >= 0):
        if not np.isfinite(host).all():
            raise InvalidDistribution("probabilities contain NaN or inf")
        raise InvalidDistribution(f"probabilities contain negative entries (min {float(host.min())})")
    worst = float(np.abs(total - 1.0).max())
    if worst > atol:
        raise InvalidDistribution(f"probabilities sum off 1 by {worst:.3g} (tolerance {atol})")
    return torch.from_numpy(host / total).to(p.device)  # [..., vocab] float64


def processed_logprobs(logits: torch.Tensor, params: SamplingParams, context: Context) -> torch.Tensor:
    """The log of each row's processed distribution: ``[N, vocab]`` -> ``[N, vocab]`` float64.

    ``log_softmax`` (in float64) of :func:`process_logits`: for a sampled request
    the log of exactly the distribution :func:`logits_to_probs` samples from
    (removed tokens ``-inf``). For a greedy request (``temperature == 0``) the
    processing greedy decoding applies, the repetition penalty alone, then the
    softmax at temperature 1: the distribution whose argmax greedy decoding takes
    (a one-hot would say nothing). This is what a request's logprobs report.
    """
    scores = process_logits(logits, params, context)  # [N, vocab] float32
    return torch.log_softmax(scores.to(torch.float64), dim=-1)  # [N, vocab] float64


def pick_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], top_n: int
) -> tuple[PositionLogprobs, ...]:
    """Each emitted token's log probability and the ``top_n`` most likely tokens of its row.

    ``logprobs``: ``[N, vocab]`` float64 (:func:`processed_logprobs`), row ``i`` the
    distribution ``token_ids[i]`` was emitted from. The alternatives are listed most
    likely first (the lower id first on ties among those listed); tokens of
    probability 0 (``-inf``) are never listed, so a row may list fewer than ``top_n``.
    """
    if logprobs.dim() != 2 or logprobs.shape[0] != len(token_ids):
        raise InvalidArgument(f"logprobs must be [{len(token_ids)}, vocab], got {tuple(logprobs.shape)}")
    if not token_ids:
        return ()
    rows = torch.arange(len(token_ids), device=logprobs.device)
    chosen = logprobs[rows, torch.as_tensor(list(token_ids), device=logprobs.device)].tolist()  # [N]
    k = min(top_n, logprobs.shape[-1])
    tops: list[list[TokenLogprob]] = [[] for _ in token_ids]
    if k > 0:
        values, indices = torch.topk(logprobs, k, dim=-1)  # [N, k], [N, k]
        for i, (vals, ids) in enumerate(zip(values.tolist(), indices.tolist(), strict=True)):
            picks = sorted((-v, t) for v, t in zip(vals, ids, strict=True) if math.isfinite(v))
            tops[i] = [TokenLogprob(token_id=t, logprob=-nv) for nv, t in picks]
    return tuple(
        PositionLogprobs(token_id=int(t), logprob=float(lp), top_logprobs=tuple(top))
        for t, lp, top in zip(token_ids, chosen, tops, strict=True)
    )
