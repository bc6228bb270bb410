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
distribution passes through.
"""

from __future__ import annotations

from collections.abc import Sequence

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

from specserve.errors import InvalidArgument, InvalidDistribution
from specserve.params import SamplingParams

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
        no_ids = torch.zeros((rows, 0), dtype=torch.int64, device=scores.device)
        scores = warpers(no_ids, scores)
    return scores  # [N, vocab] float32


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, context: Context) -> torch.Tensor:
    """The distribution each row is sampled from: ``[N, vocab]`` -> ``[N, vocab]`` float64.

    Sampling: softmax (in float64) of :func:`process_logits`. Greedy
    (``temperature == 0``): one-hot at the argmax of the processed logits, the
    lowest token id on ties (``torch.argmax``, as HF greedy decoding).
    """
    scores = process_logits(logits, params, context)  # [N, vocab] float32
    if params.greedy:
        probs = torch.zeros(scores.shape, dtype=torch.float64, device=scores.device)  # [N, vocab]
        probs.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    return torch.softmax(scores.to(torch.float64), dim=-1)  # [N, vocab] float64


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


def check_distribution(probs: torch.Tensor, *, atol: float = 1e-3) -> torch.Tensor:
    """Validate ``[..., vocab]`` probabilities and return them as float64, renormalised.

    Raises :class:`~specserve.errors.InvalidDistribution` on NaN, infinite or
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
    if not bool(torch.isfinite(p).all()):
        raise InvalidDistribution("probabilities contain NaN or inf")
    if bool((p < 0).any()):
        raise InvalidDistribution(f"probabilities contain negative entries (min {float(p.min())})")
    host = np.ascontiguousarray(p.cpu().numpy())  # [..., vocab]
    total = np.add.reduce(host, axis=-1, keepdims=True)  # [..., 1]
    worst = float(np.abs(total - 1.0).max())
    if worst > atol:
        raise InvalidDistribution(f"probabilities sum off 1 by {worst:.3g} (tolerance {atol})")
    return torch.from_numpy(host / total).to(p.device)  # [..., vocab] float64
