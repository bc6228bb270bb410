"""One padded forward pass for many sessions, and the split of its results.

Every session brings the key/value tensors it already holds (its *past*,
``past_len`` tokens, batch 1) and the tokens to feed now (committed tokens its
cache lacks, the pending token, then the proposal). Pasts and inputs are
ragged. :func:`pack` lays each row out as::

    [ left padding | past_b | input_b | right padding ]
      <------- width L ----> <------ width T -------->

so that every row's past ends at the same column ``L`` (the batched cache's
length) and its input starts there. The attention mask hides both paddings,
explicit position ids give each real token its true position (RoPE keys were
rotated at their own positions when they were cached; learned position
embeddings are looked up from ``position_ids``), so a row's logits and new
keys/values equal those of the session run alone, up to float rounding.
Right padding (not left) for the inputs keeps every padded query after at least
one real key, so no attention row is fully masked (which would give NaN).

:func:`new_kv` takes each row's new keys/values back out (``[1, heads, t_b,
head_dim]`` per layer) and :func:`row_logits` its logits, ready for the
session's own cache and the verifier.

Pure tensor code: no model, Redis or gRPC here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

#: One session's cached keys/values: per layer ``(keys, values)``, each ``[1, heads, past_len, head_dim]``.
LayerKV = tuple[tuple[Tensor, Tensor], ...]


@dataclass(frozen=True)
class RowInput:
    """What one session contributes to a batched pass."""

    past: LayerKV | None  # per layer [1, heads, past_len, head_dim]; None when past_len == 0
    past_len: int
    input_ids: tuple[int, ...]  # tokens to feed, at positions past_len, past_len + 1, ...
    logits_needed: int | None = None  # logits wanted for the last this-many inputs; None: all

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("a row must feed at least one token")
        if self.logits_needed is not None and not 1 <= self.logits_needed <= len(self.input_ids):
            raise ValueError(f"logits_needed must be in [1, {len(self.input_ids)}], got {self.logits_needed}")
        if (self.past is None) != (self.past_len == 0):
            raise ValueError("past must be given exactly when past_len > 0")


@dataclass
class PackedBatch:
    """Model inputs for one padded pass over ``batch`` rows."""

    input_ids: Tensor  # [batch, T] int64
    attention_mask: Tensor  # [batch, L + T] int64, 1 = real token
    position_ids: Tensor  # [batch, T] int64
    cache: DynamicCache | None  # per layer [batch, heads, L, head_dim]; None when L == 0
    past_width: int  # L
    input_lens: tuple[int, ...]  # t_b, real inputs per row
    logits_needed: tuple[int, ...]  # k_b: logits kept for row b's last k_b real inputs
    logits_from: int  # first input column whose logits the pass computes (min over rows of t_b - k_b)

    @property
    def positions_processed(self) -> int:
        """Real (unpadded) positions fed: the useful work of the pass."""
        return sum(self.input_lens)


def pack(rows: Sequence[RowInput], *, config, device: torch.device | str) -> PackedBatch:
    """Lay out ``rows`` as one left/right-padded batch (see the module docstring)."""
    if not rows:
        raise ValueError("pack needs at least one row")
    batch = len(rows)
    width = max(r.past_len for r in rows)  # L
    longest = max(len(r.input_ids) for r in rows)  # T
    input_ids = torch.zeros(batch, longest, dtype=torch.long)
    attention_mask = torch.zeros(batch, width + longest, dtype=torch.long)
    position_ids = torch.zeros(batch, longest, dtype=torch.long)
    for b, row in enumerate(rows):
        t = len(row.input_ids)
        input_ids[b, :t] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[b, width - row.past_len : width + t] = 1
        # Padded queries repeat the last real position; their outputs are discarded.
        position_ids[b] = torch.arange(row.past_len, row.past_len + longest).clamp(max=row.past_len + t - 1)
    cache = _padded_cache(rows, width, config) if width > 0 else None
    needed = tuple(r.logits_needed or len(r.input_ids) for r in rows)
    return PackedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        cache=cache,
        past_width=width,
        input_lens=tuple(len(r.input_ids) for r in rows),
        logits_needed=needed,
        logits_from=min(len(r.input_ids) - k for r, k in zip(rows, needed, strict=True)),
    )


def _padded_cache(rows: Sequence[RowInput], width: int, config) -> DynamicCache:
    template = next(r.past for r in rows if r.past is not None)
    layers = []
    for layer, (k0, v0) in enumerate(template):
        # k0: [1, heads, past_len, head_dim]
        keys = k0.new_zeros(len(rows), k0.shape[1], width, k0.shape[3])  # [batch, heads, L, head_dim]
        values = v0.new_zeros(len(rows), v0.shape[1], width, v0.shape[3])
        for b, row in enumerate(rows):
            if row.past is not None:
                k, v = row.past[layer]
                keys[b, :, width - row.past_len :] = k[0]
                values[b, :, width - row.past_len :] = v[0]
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers, config=config)


def forward(model, packed: PackedBatch) -> tuple[Tensor, DynamicCache]:
    """Run ``model`` once over ``packed``; returns logits ``[batch, T - logits_from, vocab]`` (float32) and the
    grown cache. Only the columns some row needs get logits (a long catch-up row costs no vocab-wide rows)."""
    cache = packed.cache if packed.cache is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=packed.input_ids.shape[1] - packed.logits_from,
        )
    return out.logits.float(), cache


def row_logits(logits: Tensor, packed: PackedBatch, b: int) -> Tensor:
    """Row ``b``'s logits at its last ``k_b`` real inputs: ``[k_b, vocab]`` from :func:`forward`'s logits."""
    stop = packed.input_lens[b] - packed.logits_from
    return logits[b, stop - packed.logits_needed[b] : stop]


def new_kv(cache: DynamicCache, packed: PackedBatch, b: int) -> LayerKV:
    """Row ``b``'s keys/values of the tokens just fed: per layer ``[1, heads, t_b, head_dim]``."""
    start, stop = packed.past_width, packed.past_width + packed.input_lens[b]
    return tuple(
        (layer.keys[b : b + 1, :, start:stop].clone(), layer.values[b : b + 1, :, start:stop].clone())
        for layer in cache.layers
    )
