"""One padded forward pass for many sessions, the steps after it, and the split of the results.

Both tiers batch sessions with this module: the target for its verify pass,
the draft for each drafting step (``specserve/draft/proposers.py``).

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
keys/values equal those of the session run alone, up to float rounding
(``specserve/engine/row_invariant.py`` makes them bitwise equal where that is needed).
Right padding (not left) for the inputs keeps every padded query after at least
one real key, so no attention row is fully masked (which would give NaN).

The batched cache is preallocated: ``pack(..., room=n)`` leaves ``n`` free
columns after the inputs, so the pass writes its inputs' keys/values in place
and ``n`` later single-token steps do too (no copy of the whole cache per
step). Steps after the first (the draft's decoding) go through:

* :func:`align_ends`: after a ragged pass, slide each short row's tokens right
  so that every row ends at the same column; the next tokens then append
  after every row's own tokens, and each row's keys stay contiguous
  (``PackedBatch.spans``);
* :func:`next_step`: one token more for each row that goes on; rows that stop
  drop out (their cache rows are removed, :func:`new_kv` first).

:func:`new_kv` takes a row's new keys/values back out (everything fed since
:func:`pack`: ``[1, heads, fed_b, head_dim]`` per layer) and :func:`row_logits`
its logits, ready for the session's own cache and the verifier.

Pure tensor code: no model, Redis or gRPC here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: One session's cached keys/values: per layer ``(keys, values)``, each ``[1, heads, past_len, head_dim]``.
LayerKV = tuple[tuple[Tensor, Tensor], ...]


@dataclass(frozen=True)
class RowInput:
    """What one session contributes to a batched pass."""

    past: LayerKV | None  # per layer [1, heads, past_len, head_dim]; None when past_len == 0
    past_len: int
    input_ids: tuple[int, ...]  # tokens to feed, at positions past_len, past_len + 1, ...
    logits_needed: int | None = None  # logits wanted for the last this-many inputs; None: all
    #: A draft tree in the last ``len(tree)`` inputs: node ``i``'s parent (``-1``: the token before the nodes,
    #: the last chain input or, when every input is a node, the past's last; else an earlier node). Node ``i``
    #: sits at the position after its parent's and attends to the past, the inputs before the nodes and its
    #: own path only (:func:`input_mask`). None: every input is a chain.
    tree: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("a row must feed at least one token")
        if self.tree is not None and not 0 < len(self.tree) <= len(self.input_ids):
            raise ValueError("a tree has 1 to len(input_ids) nodes, the last inputs")
        if self.tree is not None and len(self.tree) == len(self.input_ids) and self.past_len == 0:
            raise ValueError("a tree's nodes follow at least one token (a chain input or the past's)")
        if self.logits_needed is not None and not 1 <= self.logits_needed <= len(self.input_ids):
            raise ValueError(f"logits_needed must be in [1, {len(self.input_ids)}], got {self.logits_needed}")
        if (self.past is None) != (self.past_len == 0):
            raise ValueError("past must be given exactly when past_len > 0")


@dataclass(frozen=True)
class PackedBatch:
    """Model inputs for one padded pass over ``batch`` rows, and where each row's tokens sit."""

    input_ids: Tensor  # [batch, T] int64
    attention_mask: Tensor  # [batch, L + T] int64, 1 = real token
    position_ids: Tensor  # [batch, T] int64
    cache: DynamicCache | None  # per layer [batch, heads, L, head_dim]; None when L == 0 and no room
    past_width: int  # L: cache columns before this pass
    input_lens: tuple[int, ...]  # t_b, real inputs per row
    logits_needed: tuple[int, ...]  # k_b: logits kept for row b's last k_b real inputs
    logits_from: int  # first input column whose logits the pass computes (min over rows of t_b - k_b)
    spans: tuple[tuple[int, int], ...]  # row b's tokens (past and inputs) in cache columns [start, stop)
    fed: tuple[int, ...]  # tokens fed to row b since pack, this pass included (new_kv returns their KV)
    #: Row b's draft tree (RowInput.tree); empty: no row has one.
    trees: tuple[tuple[int, ...] | None, ...] = ()

    @property
    def positions_processed(self) -> int:
        """Real (unpadded) positions fed: the useful work of the pass."""
        return sum(self.input_lens)

    @property
    def batch_size(self) -> int:
        return len(self.input_lens)


class RoomyLayer(DynamicLayer):
    """A full-attention cache layer with preallocated room: ``update`` writes in place while room lasts.

    ``keys`` / ``values`` are views ``[batch, heads, length, head_dim]`` of the
    buffers (HF's ``DynamicLayer`` concatenates, a copy of the whole layer per step).
    """

    def __init__(self, room: int = 0) -> None:
        super().__init__()
        self.room = room
        self._k: Tensor | None = None  # [batch, heads, capacity, head_dim]
        self._v: Tensor | None = None
        self._len = 0

    @classmethod
    def padded(cls, pasts: Sequence[tuple[Tensor, Tensor] | None], width: int, room: int) -> RoomyLayer:
        """A layer holding each row's past (``[1, heads, past_len, head_dim]``, or None) right-aligned at
        column ``width``, left-padded with zeros, with ``room`` free columns after it."""
        template = next(kv for kv in pasts if kv is not None)[0]  # [1, heads, past_len, head_dim]
        layer = cls(room)
        layer._allocate(template.expand(len(pasts), -1, -1, -1), width + room)
        assert layer._k is not None and layer._v is not None
        for b, kv in enumerate(pasts):
            if kv is not None:
                k, v = kv
                layer._k[b, :, width - k.shape[2] : width] = k[0]
                layer._v[b, :, width - v.shape[2] : width] = v[0]
        layer._len = width
        layer.keys = layer._k[:, :, :width]
        layer.values = layer._v[:, :, :width]
        return layer

    def _allocate(self, like: Tensor, capacity: int) -> None:
        batch, heads, _, dim = like.shape
        self._k = like.new_zeros(batch, heads, capacity, dim)
        self._v = like.new_zeros(batch, heads, capacity, dim)
        self._len = 0
        self.device = like.device
        self.is_initialized = True

    def _write(self, key_states: Tensor, value_states: Tensor) -> None:
        assert self._k is not None and self._v is not None
        n = key_states.shape[-2]
        if self._len + n > self._k.shape[-2]:  # out of room: grow (one copy)
            grow = max(n, self.room, self._len)
            self._k = torch.cat(
                [self._k, self._k.new_zeros(*self._k.shape[:2], grow, self._k.shape[-1])], dim=-2
            )
            self._v = torch.cat(
                [self._v, self._v.new_zeros(*self._v.shape[:2], grow, self._v.shape[-1])], dim=-2
            )
        self._k[:, :, self._len : self._len + n] = key_states
        self._v[:, :, self._len : self._len + n] = value_states
        self._len += n
        self.keys = self._k[:, :, : self._len]
        self.values = self._v[:, :, : self._len]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self._allocate(key_states, key_states.shape[-2] + self.room)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._write(key_states, value_states)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the (negative) number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._len = max(0, self._len + tokens_to_remove)
        self.keys = self._k[:, :, : self._len]
        self.values = self._v[:, :, : self._len]

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys = self._k[:, :, : self._len]
            self.values = self._v[:, :, : self._len]

    def shift_row(self, b: int, start: int, stop: int, by: int) -> None:
        """Move row ``b``'s columns ``[start, stop)`` right by ``by`` (to ``[start + by, stop + by)``)."""
        assert self._k is not None and self._v is not None
        for buf in (self._k, self._v):
            buf[b, :, start + by : stop + by] = buf[b, :, start:stop].clone()


def _num_layers(config) -> int:
    return int(config.get_text_config(decoder=True).num_hidden_layers)


def pack(rows: Sequence[RowInput], *, config, device: torch.device | str, room: int = 0) -> PackedBatch:
    """Lay out ``rows`` as one left/right-padded batch (see the module docstring).

    The batched cache holds the pasts with room for the inputs plus ``room``
    later tokens per row.
    """
    if not rows:
        raise ValueError("pack needs at least one row")
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
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
        if row.tree is not None:  # each node at its parent's position + 1
            position_ids[b, :t] = input_positions(row.past_len, t, row.tree)
            position_ids[b, t:] = position_ids[b, :t].max()
    if width > 0:
        cache = _padded_cache(rows, width, config, room=longest + room)
    elif room > 0:
        cache = _empty_cache(config, room=room)  # each layer allocates T + room on its first update
    else:
        cache = None
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
        spans=tuple((width - r.past_len, width + len(r.input_ids)) for r in rows),
        fed=tuple(len(r.input_ids) for r in rows),
        trees=tuple(r.tree for r in rows) if any(r.tree is not None for r in rows) else (),
    )


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1 below the input before the nodes) from its parent (``-1`` or an earlier node)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def input_positions(past_len: int, inputs: int, parents: Sequence[int] | None) -> Tensor:
    """``[inputs]`` positions of a row's inputs after ``past_len`` cached tokens: consecutive for a chain; the
    last ``len(parents)`` inputs (a tree, :attr:`RowInput.tree`) each at its parent's position + 1."""
    positions = torch.arange(past_len, past_len + inputs)
    if parents:
        chain = inputs - len(parents)
        positions[chain:] = past_len + chain - 1 + torch.tensor(tree_depths(parents))
    return positions


def tree_pass_inputs(past_len: int, inputs: int, parents: Sequence[int], dtype: torch.dtype,
                     device: torch.device | str) -> dict[str, Tensor]:
    """The ``attention_mask`` (4D additive, ``[1, 1, inputs, past_len + inputs]``) and ``position_ids``
    (``[1, inputs]``) of one unpadded row whose last ``len(parents)`` inputs are a draft tree: what a
    session's own cache feeds the model (``SessionCache.extend_tree``); :func:`pack` lays out the same for
    a batch."""
    allowed = torch.ones(inputs, past_len + inputs, dtype=torch.bool)
    allowed[:, past_len:] = input_mask(inputs, parents)
    mask = torch.zeros(1, 1, inputs, past_len + inputs, dtype=dtype)
    mask[0, 0].masked_fill_(~allowed, torch.finfo(dtype).min)
    return {"attention_mask": mask.to(device), "position_ids": input_positions(past_len, inputs, parents)[None].to(device)}


def input_mask(inputs: int, parents: Sequence[int] | None) -> Tensor:
    """``[inputs, inputs]`` bool: whether input ``i`` attends to input ``j`` of its row (each sees every past
    token too). Causal for a chain; the last ``len(parents)`` inputs (a tree, :attr:`RowInput.tree`) see the
    inputs before them and their own path (the node and its ancestors)."""
    mask = torch.ones(inputs, inputs, dtype=torch.bool).tril()  # [t, t]
    if parents:
        chain = inputs - len(parents)
        nodes = mask[chain:, chain:]  # [m, m]: a view, rebuilt as the ancestor mask
        nodes.zero_()
        for i, parent in enumerate(parents):
            if parent >= 0:
                nodes[i] = nodes[parent]
            nodes[i, i] = True
    return mask


def _tree_attention_mask(packed: PackedBatch, dtype: torch.dtype) -> Tensor:
    """The 4D additive mask ``[batch, 1, T, L + T]`` of a pass with a draft tree in some row: the 2D mask's
    padding, causal order among the inputs, and each tree's ancestor mask (:func:`input_mask`). A padded query
    sees what its row's last real input sees (no row is fully masked)."""
    batch, longest = packed.input_ids.shape
    width = packed.past_width
    padding = packed.attention_mask.bool()[:, None, None, :]  # [batch, 1, 1, L + T]
    allowed = padding.expand(batch, 1, longest, width + longest).clone()
    for b, t in enumerate(packed.input_lens):
        among = torch.zeros(longest, longest, dtype=torch.bool)  # [T, T]
        among[:t, :t] = input_mask(t, packed.trees[b])
        among[t:, :t] = among[t - 1, :t]
        allowed[b, 0, :, width:] &= among.to(allowed.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _padded_cache(rows: Sequence[RowInput], width: int, config, *, room: int) -> DynamicCache:
    """Per layer ``[batch, heads, L + room, head_dim]``: each row's past ending at column ``L``."""
    layers = len(next(r.past for r in rows if r.past is not None))
    return _cache_of(
        [
            RoomyLayer.padded([r.past[layer] if r.past is not None else None for r in rows], width, room)
            for layer in range(layers)
        ],
        config,
    )


def _empty_cache(config, *, room: int) -> DynamicCache:
    return _cache_of([RoomyLayer(room) for _ in range(_num_layers(config))], config)


def _cache_of(layers: list[RoomyLayer], config) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = list(layers)
    return cache


def forward(model, packed: PackedBatch, **model_kwargs) -> tuple[Tensor, DynamicCache]:
    """Run ``model`` once over ``packed``; returns logits ``[batch, T - logits_from, vocab]`` (float32) and the
    grown cache. Only the columns some row needs get logits (a long catch-up row costs no vocab-wide rows).
    ``model_kwargs`` go to the model (and on to its attention function)."""
    cache = packed.cache if packed.cache is not None else DynamicCache(config=model.config)
    attention_mask = packed.attention_mask
    if packed.trees and "row_layout" not in model_kwargs:  # a layout's attention takes the trees from it
        attention_mask = _tree_attention_mask(packed, next(model.parameters()).dtype)
    with torch.no_grad():
        out = model(
            input_ids=packed.input_ids,
            attention_mask=attention_mask,
            position_ids=packed.position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=packed.input_ids.shape[1] - packed.logits_from,
            **model_kwargs,
        )
    return out.logits.float(), cache


def row_logits(logits: Tensor, packed: PackedBatch, b: int) -> Tensor:
    """Row ``b``'s logits at its last ``k_b`` real inputs: ``[k_b, vocab]`` from :func:`forward`'s logits."""
    stop = packed.input_lens[b] - packed.logits_from
    return logits[b, stop - packed.logits_needed[b] : stop]


def last_logits(logits: Tensor, packed: PackedBatch) -> Tensor:
    """Every row's logits at its last real input: ``[batch, vocab]`` from :func:`forward`'s logits."""
    ends = [t - packed.logits_from - 1 for t in packed.input_lens]
    if len(set(ends)) == 1:  # every row ends in the same column (each decoding step): a view, no copy
        return logits[:, ends[0]]
    return logits[torch.arange(packed.batch_size, device=logits.device), ends]


def new_kv(cache: DynamicCache, packed: PackedBatch, b: int) -> LayerKV:
    """Row ``b``'s keys/values of the tokens fed since :func:`pack`: per layer ``[1, heads, fed_b, head_dim]``."""
    stop = packed.spans[b][1]
    start = stop - packed.fed[b]
    return tuple(
        (layer.keys[b : b + 1, :, start:stop].clone(), layer.values[b : b + 1, :, start:stop].clone())
        for layer in cache.layers
    )


def align_ends(packed: PackedBatch, cache: DynamicCache) -> PackedBatch:
    """After a pass with ragged inputs: slide each short row right so every row's tokens end at the last column.

    Afterwards row ``b`` holds columns ``[W - n_b, W)`` (``W = L + T``, ``n_b``
    its past and inputs), so tokens fed by :func:`next_step` follow each row's
    own tokens without a gap. Moves only rows with ``t_b < T``.
    """
    end = packed.past_width + packed.input_ids.shape[1]  # W
    mask = packed.attention_mask.clone()
    spans = []
    for b, (start, stop) in enumerate(packed.spans):
        by = end - stop
        if by:
            for layer in cache.layers:
                assert isinstance(layer, RoomyLayer), "align_ends needs the cache pack() made"
                layer.shift_row(b, start, stop, by)
            mask[b] = 0
            mask[b, start + by : end] = 1
        spans.append((start + by, end))
    return replace(packed, attention_mask=mask, spans=tuple(spans))


def next_step(
    packed: PackedBatch, cache: DynamicCache, token_ids: Sequence[int], keep: Sequence[int]
) -> PackedBatch:
    """The single-token pass after ``packed`` (aligned, :func:`align_ends`) for the rows ``keep``.

    Row ``keep[i]`` of ``packed`` becomes row ``i`` and feeds ``token_ids[i]``;
    every other row drops out (take its :func:`new_kv` first): its cache rows go.
    """
    if len(token_ids) != len(keep) or not keep:
        raise ValueError("next_step needs one token per kept row, and at least one row")
    end = packed.spans[0][1]
    if any(stop != end for _, stop in packed.spans):
        raise ValueError("next_step needs every row to end at the same column (align_ends)")
    index = torch.tensor(list(keep), dtype=torch.long)
    if len(keep) != packed.batch_size:
        for layer in cache.layers:
            layer.batch_select_indices(index.to(layer.keys.device))
    device = packed.input_ids.device
    mask = packed.attention_mask.index_select(0, index.to(device))  # [batch', W]
    mask = torch.cat(
        [mask, torch.ones(len(keep), 1, dtype=mask.dtype, device=device)], dim=1
    )  # [batch', W + 1]
    positions = torch.tensor(
        [[packed.spans[b][1] - packed.spans[b][0]] for b in keep], dtype=torch.long, device=device
    )  # [batch', 1]: row b holds n_b tokens at positions 0..n_b-1
    return PackedBatch(
        input_ids=torch.tensor([[int(t)] for t in token_ids], dtype=torch.long, device=device),  # [batch', 1]
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        past_width=end,
        input_lens=(1,) * len(keep),
        logits_needed=(1,) * len(keep),
        logits_from=0,
        spans=tuple((packed.spans[b][0], end + 1) for b in keep),
        fed=tuple(packed.fed[b] + 1 for b in keep),
    )
