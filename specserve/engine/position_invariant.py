"""Target passes whose logits at a position are the same bits however the position is computed.

The contract (docs/design.md, "Numerics"): with a model prepared by
:func:`prepare`, a position's logits are bitwise equal (``torch.equal``)
whether they come from a one-position decoding step, a verify pass over k
positions, a prefill of any length (whole or in pieces), a batched pass with
any batch-mates and padding (:func:`forward`), on any replica that runs the
same software on the same kind of CPU with the same ``kernels`` setting.
Greedy output is then the target alone's token for token, and a coupled
session's text does not depend on its batch-mates or on a failover.

Stock kernels break this in three places, each fixed here by a reduction
order that depends on the row alone:

* **Linear layers** pick their kernel by row count (one row runs another
  kernel than five). :class:`InvariantLinear` runs every linear layer on blocks
  of exactly :data:`~specserve.engine.row_invariant.ROW_BLOCK` rows, the last
  zero-padded (the draft's row-invariant linears,
  :mod:`specserve.engine.row_invariant`): for one fixed shape the kernel
  computes each row from that row alone, wherever it sits in the block. With
  packed oneDNN weights (``kernels="onednn"``, or ``"auto"`` where oneDNN is
  available) a block holds up to :data:`PACKED_BLOCK` rows and goes unpadded
  (a lone row padded to 2 where it takes another kernel) where the kernel gives
  a row the same bits for every row count up to that, checked per weight
  shape at load (:func:`fewest_block_rows`); a shape that fails keeps the
  padded 16-row blocks.
* **Attention** (SDPA) takes another path for 1, 2-3 and 4+ query rows, and
  its reduction over the keys depends on how many keys the tensor holds, the
  padding included. :func:`invariant_attention` splits each row's own keys
  (from its position 0, whatever padding precedes them in the batch) into
  chunks of :data:`KEY_CHUNK` keys; the scores and the weighted values are
  matrix products of at least :data:`MIN_QUERY_ROWS` rows over keys padded to
  whole chunks (from that many rows the CPU's matmul gives a row the same bits
  whatever the row count: :func:`products_row_invariant`, checked at load),
  the softmax's maximum is exact, and the chunks' sums are added in
  chunk order. Keys a query may not see (later positions, padding past the
  row's end) are masked inside the chunk, which adds exact zeros, and chunks
  wholly past a query add zeros after its last real chunk: no bit moves.
* **The kernel path** was chosen by timing at load (``kernels=fastest``), so
  two replicas could run different kernels. A prepared model's path is the
  deployment's ``kernels`` setting (``stock`` or ``onednn``), the same on
  every replica; ``fastest`` is refused (``TargetSettings``).

Everything else in a Llama-like pass is row-wise already (embeddings, norms,
rotary positions, activations). ``tests/specserve/engine/test_position_invariant.py``
checks the property on a tiny Llama with the default target's head shapes (9
query heads over 3 key/value heads), and that the fixed-shape kernels behave
as assumed on the machine that runs the tests.

The price, on the stock kernel, is a matmul of 16 rows for a lone decoding
row; on packed weights little beyond the attention's smaller pieces. Measured
on the default target: docs/benchmarks/invariance.md
(``python -m benchmarks invariance``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from specserve.engine import attention, batching, cpu_kernels
from specserve.engine.row_invariant import ROW_BLOCK, RowLayout, _blocked

#: Most rows per call of a packed linear layer whose kernel keeps a row's bits whatever the row count (checked
#: for the shape at load, :func:`fewest_block_rows`): a batched verify pass or a prefill in few weight reads.
PACKED_BLOCK = 64
#: Keys per chunk of the attention's reduction: a row's keys from its position 0 in chunks of this many.
KEY_CHUNK = 64
#: Fewest rows of the attention's matrix products (a key/value head's query heads x positions, zero-padded):
#: from 4 rows on the kernel gives a row the same bits whatever the row count (checked by the tests).
MIN_QUERY_ROWS = 4
#: Query rows per piece of a long pass (bounds the scores' memory; the result does not depend on it).
QUERY_PIECE = 192
#: The name :func:`invariant_attention` is registered under with transformers.
ATTENTION = "specserve_invariant"


class InvariantLinear(nn.Module):
    """``F.linear`` on blocks of exactly ``ROW_BLOCK`` rows (the last zero-padded), on the stock kernel or on
    a packed oneDNN weight (:class:`specserve.engine.cpu_kernels.PackedLinear`); inference only."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if not _swappable(layer):
            raise TypeError(f"an invariant linear wraps an nn.Linear, a PackedLinear or a Conv1D, not {type(layer).__name__}")
        if isinstance(layer, Conv1D):  # GPT-2's linear layers: weight [in, out], torch.addmm
            self.in_features, self.out_features = layer.weight.shape
        else:
            self.out_features, self.in_features = layer.out_features, layer.in_features
        self.layer = layer  # a submodule: its weights stay the model's parameters (tied ones too)
        #: Packed weights only: the fewest rows from which the kernel gives a row the same bits for any row
        #: count up to ``PACKED_BLOCK`` (:func:`fewest_block_rows`); blocks of up to ``PACKED_BLOCK`` rows then
        #: go unpadded down to it. None: blocks of exactly ``ROW_BLOCK`` rows, zero-padded.
        self.fewest_rows: int | None = None
        if isinstance(layer, cpu_kernels.PackedLinear):
            key = (layer.out_features, layer.in_features, layer.bias is not None, torch.get_num_threads())
            if key not in _FEWEST:
                _FEWEST[key] = fewest_block_rows(self._packed_matmul, layer.in_features)
            self.fewest_rows = _FEWEST[key]

    @property
    def kernels(self) -> str:
        return "onednn" if isinstance(self.layer, cpu_kernels.PackedLinear) else "stock"

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        layer = self.layer
        if isinstance(layer, Conv1D):
            return _blocked(x, lambda block: torch.addmm(layer.bias, block, layer.weight))
        if not isinstance(layer, cpu_kernels.PackedLinear):
            return _blocked(x, lambda block: F.linear(block, layer.weight, layer.bias))
        if self.fewest_rows is None:
            return _blocked(x, self._packed_matmul)
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        if flat.shape[0] <= PACKED_BLOCK:  # one block (every decoding step, most verify passes)
            return cpu_kernels.pad_rows(x, self.fewest_rows, self._packed_matmul)
        out = torch.cat(
            [cpu_kernels.pad_rows(block, self.fewest_rows, self._packed_matmul) for block in flat.split(PACKED_BLOCK)]
        )  # [M, out]: blocks of up to PACKED_BLOCK rows, each padded to fewest_rows at least
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _packed_matmul(self, rows: Tensor) -> Tensor:  # [m, in] -> [m, out]
        layer = self.layer
        assert isinstance(layer, cpu_kernels.PackedLinear)
        return cpu_kernels.packed_linear(rows, layer.packed, layer.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels={self.kernels}"


def _swappable(layer: nn.Module) -> bool:
    return type(layer) in (nn.Linear, Conv1D) or isinstance(layer, cpu_kernels.PackedLinear)


#: (out, in, bias, threads) -> fewest_block_rows of a packed weight of that shape (the kernel depends on the shape).
_FEWEST: dict[tuple[int, int, bool, int], int | None] = {}


def fewest_block_rows(run: Callable[[Tensor], Tensor], in_features: int) -> int | None:
    """The fewest rows ``f`` (1 or 2) such that a call of ``run`` (a matmul ``[m, in] -> [m, out]``) gives each
    row the same bits for every row count ``m`` from ``f`` to :data:`PACKED_BLOCK` and wherever the row sits (a
    lone row padded to ``f``); None when neither holds. Checked bit for bit on random rows, once per shape:
    every count up to ``ROW_BLOCK`` at three places, and the counts around each power of two above it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PACKED_BLOCK, in_features, generator=gen)  # [64, in]
    counts = sorted(
        {*range(1, ROW_BLOCK + 1), ROW_BLOCK + 1, 24, 31, 32, 33, 48, PACKED_BLOCK - 1, PACKED_BLOCK}
    )
    with torch.inference_mode():
        whole = run(x)  # [64, out]
        for fewest in (1, 2):
            if all(
                torch.equal(cpu_kernels.pad_rows(x[a : a + m], fewest, run), whole[a : a + m])
                for m in counts
                for a in ({0, (ROW_BLOCK - m) // 2, ROW_BLOCK - m} if m <= ROW_BLOCK else {0, PACKED_BLOCK - m})
            ):
                return fewest
    return None


#: (head dim, threads) -> whether the attention's products keep a row's bits from MIN_QUERY_ROWS rows on.
_PRODUCTS_CHECKED: dict[tuple[int, int], bool] = {}


def products_row_invariant(head_dim: int) -> bool:
    """Whether float32 ``[m, K] x [K, N]`` products (``K`` the head dim for the scores, :data:`KEY_CHUNK` for
    the values) give a row the same bits for every row count ``m >= MIN_QUERY_ROWS``, wherever it sits and
    whatever ``N``: the kernel property :func:`invariant_attention` relies on, checked once per head dim."""
    key = (head_dim, torch.get_num_threads())
    if key not in _PRODUCTS_CHECKED:
        gen = torch.Generator().manual_seed(0)
        ok = True
        with torch.inference_mode():
            for k_dim in (head_dim, KEY_CHUNK):
                a = torch.randn(2, 300, k_dim, generator=gen)  # [2, rows, K]
                b = torch.randn(2, k_dim, 3 * KEY_CHUNK, generator=gen)  # [2, K, N]
                whole = torch.matmul(a, b)  # [2, rows, N]
                for m in (MIN_QUERY_ROWS, MIN_QUERY_ROWS + 1, 7, 16, 33, 100):
                    for at in (0, 11, 300 - m):
                        ok = ok and torch.equal(torch.matmul(a[:, at : at + m], b), whole[:, at : at + m])
                ok = ok and torch.equal(torch.matmul(a[:, :8], b[:, :, :KEY_CHUNK]), whole[:, :8, :KEY_CHUNK])
        _PRODUCTS_CHECKED[key] = ok
    return _PRODUCTS_CHECKED[key]


def _row_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One session's attention: ``q [H, t, d]`` at the last ``t`` of the ``n`` positions of ``k/v [KV, n, d]``
    (query ``i`` sees keys ``0 .. n - t + i``) -> ``[t, H, d]``, in a reduction order fixed per query."""
    heads, t, dim = q.shape
    kv_heads, n, _ = k.shape
    groups = heads // kv_heads
    chunks = -(-n // KEY_CHUNK)
    pad = chunks * KEY_CHUNK - n  # keys past the row's end: masked, so the chunks start at the row's position 0
    # Keys padded to whole chunks: the kernel's bits for a key column hold for widths in whole chunks.
    keys = F.pad(k, (0, 0, 0, pad)).transpose(1, 2)  # [KV, d, C*64]
    values = F.pad(v, (0, 0, 0, pad)).view(kv_heads, chunks, KEY_CHUNK, dim)  # [KV, C, 64, d]
    # Row i*G + g: query i, head g of the group (position-major, so a piece of rows sees a prefix of the chunks).
    rows = (q * scale).view(kv_heads, groups, t, dim).transpose(1, 2).reshape(kv_heads, t * groups, dim)
    position = None  # [t*G]; a lone query is the last position: it sees every key
    if t > 1:
        position = torch.arange(t, device=q.device).repeat_interleave(groups) + (n - t)
    out = torch.empty(kv_heads, t * groups, dim, dtype=q.dtype, device=q.device)  # [KV, t*G, d]
    for start in range(0, t * groups, QUERY_PIECE):
        piece = rows[:, start : start + QUERY_PIECE]  # [KV, r, d]
        r = piece.shape[1]
        last = n - t + (start + r - 1) // groups  # the piece's last position: later chunks are all masked
        c = last // KEY_CHUNK + 1  # chunks the piece sees
        if r < MIN_QUERY_ROWS:  # zero rows added (they see every key: finite, and dropped)
            piece = F.pad(piece, (0, 0, 0, MIN_QUERY_ROWS - r))
        # Scores: each a dot product over the head dim, in a product of at least MIN_QUERY_ROWS rows.
        scores = torch.matmul(piece, keys[:, :, : c * KEY_CHUNK])  # [KV, r', c*64]
        scores[..., n:] = float("-inf")  # the padding past the row's end
        if position is not None:
            hidden = torch.arange(min(n, c * KEY_CHUNK), device=q.device) > position[start : start + r, None]
            scores[:, :r, :n].masked_fill_(hidden, float("-inf"))  # later positions
        top = scores.amax(dim=-1, keepdim=True)  # [KV, r', 1]: exact, order-free
        p = torch.exp(scores - top).view(kv_heads, -1, c, KEY_CHUNK)  # [KV, r', c, 64]; hidden keys: 0
        # Per chunk a sum of 64 and a [r', 64] x [64, d] product; then the chunks added in order.
        weight = torch.cumsum(p.sum(dim=-1), dim=-1)[..., -1]  # [KV, r']
        mixed = torch.matmul(p.transpose(1, 2).contiguous(), values[:, :c])  # [KV, c, r', d]
        mixed = torch.cumsum(mixed, dim=1)[:, -1]  # [KV, r', d]
        out[:, start : start + r] = (mixed / weight.unsqueeze(-1))[:, :r]
    return out.view(kv_heads, t, groups, dim).transpose(0, 1).reshape(t, heads, dim)  # [t, H, d]


def invariant_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_layout: RowLayout | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention interface: ``query [B, H, T, d]``, ``key/value [B, KV, W, d]`` -> ``[B, T, H, d]``.

    Causal attention, each query's reduction over the keys in a fixed order (the module docstring). With a
    ``row_layout`` (a batched pass, :func:`forward`), row ``b``'s first ``queries[b]`` queries attend to its
    keys ``spans[b]``, the last query to all of them; padded queries get zeros. Without one every row's
    ``T`` queries are the last ``T`` of its ``W`` positions (one session's pass on its own cache).
    """
    if dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("invariant attention is for inference: no dropout, soft-capping or position bias")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("invariant attention supports full attention only, not a sliding window")
    batch, heads, queries, dim = query.shape
    if row_layout is None:
        if attention_mask is not None and batch > 1:
            raise ValueError("a padded batch needs a row layout (position_invariant.forward)")
        row_layout = RowLayout(spans=((0, key.shape[2]),) * batch, queries=(queries,) * batch)
    if len(row_layout.spans) != batch:
        raise ValueError(f"row layout has {len(row_layout.spans)} rows, the pass {batch}")
    scale = scaling if scaling is not None else dim**-0.5
    out = query.new_zeros(batch, queries, heads, value.shape[-1])  # [B, T, H, d]
    for b, ((start, stop), t) in enumerate(zip(row_layout.spans, row_layout.queries, strict=True)):
        tree = row_layout.trees[b] if row_layout.trees else None
        q, k, v = query[b, :, :t], key[b, :, start:stop], value[b, :, start:stop]
        if tree is None:
            out[b, :t] = _row_attention(q, k, v, scale)
        else:
            out[b, :t] = _tree_row_attention(q, k, v, scale, tree)
    return out, None


def _tree_row_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, parents: tuple[int, ...]) -> Tensor:
    """One session's attention with a draft tree in its last ``m = len(parents)`` queries: ``q [H, t, d]`` at the
    last ``t`` of the ``n`` positions of ``k/v [KV, n, d]`` -> ``[t, H, d]``.

    The queries before the nodes are a chain (:func:`_row_attention`). Node ``i`` attends to the keys before the
    nodes and to its path's (its ancestors', then its own) laid out after them in depth order: the very keys, in
    the very order, a chain's decoding step at its position would see, so its output is that step's bits. Each
    node copies the keys before the nodes (simple, not the fastest: the copy grows with the context).
    """
    heads, t, dim = q.shape
    m = len(parents)
    n = k.shape[1]
    prefix = n - m  # keys before the nodes
    out = q.new_empty(t, heads, dim)  # [t, H, d]
    out[: t - m] = _row_attention(q[:, : t - m], k[:, :prefix], v[:, :prefix], scale)
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        path = [*(paths[parent] if parent >= 0 else []), prefix + i]
        paths.append(path)
        keys = torch.cat([k[:, :prefix], k[:, path]], dim=1)  # [KV, prefix + depth, d]
        values = torch.cat([v[:, :prefix], v[:, path]], dim=1)
        node = t - m + i
        out[node : node + 1] = _row_attention(q[:, node : node + 1], keys, values, scale)
    return out


def prepare(model: Any) -> int:
    """Make ``model``'s passes invariant (the module docstring): every linear layer (stock or packed, as loaded)
    becomes an :class:`InvariantLinear`, attention :func:`invariant_attention`. Returns the layers swapped
    (0 when it was prepared before). Raises ``RuntimeError`` where the CPU's matmul lacks the property the
    attention relies on (:func:`products_row_invariant`)."""
    config = model.config
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if next(model.parameters()).device.type == "cpu" and not products_row_invariant(head_dim):
        raise RuntimeError(
            f"this machine's float32 matmul gives a row different bits for different row counts at head dim "
            f"{head_dim}: invariant passes cannot be promised here; serve with invariant off (--no-invariant)"
        )
    attention.register(ATTENTION, invariant_attention)
    if config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    swapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, InvariantLinear):
            continue
        for name, child in list(parent.named_children()):
            if _swappable(child):
                setattr(parent, name, InvariantLinear(child))
                swapped += 1
    return swapped


def is_invariant(model: Any) -> bool:
    """Whether :func:`prepare` made ``model``'s passes invariant."""
    return model.config._attn_implementation == ATTENTION


def kernels_of(model: Any) -> str:
    """The kernel path of a prepared model's linear layers: "onednn", "stock", or "mixed"."""
    paths = {m.kernels for m in model.modules() if isinstance(m, InvariantLinear)}
    return paths.pop() if len(paths) == 1 else "mixed"


def forward(model: Any, packed: batching.PackedBatch) -> tuple[Tensor, object]:
    """:func:`specserve.engine.batching.forward`, with each row's layout for the attention when ``model`` is
    invariant (:func:`prepare`), so that a row's logits do not depend on its batch-mates or padding."""
    if not is_invariant(model):
        return batching.forward(model, packed)
    layout = RowLayout(spans=packed.spans, queries=packed.input_lens, trees=packed.trees)
    return batching.forward(model, packed, row_layout=layout)


__all__ = ["ATTENTION", "KEY_CHUNK", "MIN_QUERY_ROWS", "PACKED_BLOCK", "ROW_BLOCK", "InvariantLinear", "forward", "kernels_of", "prepare"]
