"""Forward passes whose result for one row does not depend on the other rows of the batch.

The draft must give a session the same proposal, ``q`` bytes included,
whether it is drafted alone or together with other sessions (docs/design.md,
"Batched drafting"). A padded batched pass (:mod:`specserve.engine.batching`) equals
the rows run alone only up to float rounding, for two reasons:

* **Matrix multiplies pick their kernel by shape.** With MKL (float32),
  row 0 of ``X @ W`` has one value when ``X`` has 1 row, another for
  2-8 rows and another from 9 rows on, and a row's value changes with its
  place in ``X``.
* **Attention over padded keys** reduces over longer, shifted vectors.

The cure is to make every row's arithmetic a function of that row alone:

1. :class:`RowBlockedMatmuls` runs every ``F.linear`` and ``torch.addmm``
   (the linear layers of Llama-like and GPT-2-like models) on blocks of exactly
   :data:`ROW_BLOCK` rows, the last block zero-padded. Every call then has the
   same shape, and for a fixed shape the kernel computes each row by the same
   instructions whatever the other rows hold and wherever the row sits in the
   block (``tests/specserve/engine/test_row_invariant.py`` checks this property of the
   kernel, and the draft's equality test checks the whole pass).
2. :func:`rowwise_attention` computes attention session by session: the
   session's real queries attend to its own keys (its span of cache columns,
   ``PackedBatch.spans``) in one ``scaled_dot_product_attention`` call, the same
   call the session makes when it is alone (a view into the batch's buffers;
   the kernel's result does not depend on strides, which the equality test
   covers too).
3. Everything else in the pass is row-wise already: embeddings, norms,
   activations, rotary or learned positions; the logits processing and the
   sampling run per row (``specserve/draft/proposers.py``).

:func:`prepare` registers the attention function with transformers (as
:data:`ATTENTION`) and switches a model to it; called without a
:class:`RowLayout` the function is plain SDPA, so the model's other callers see
no change. :func:`forward` is :func:`specserve.engine.batching.forward` with both in force.
The price: a lone row pays a matmul of :data:`ROW_BLOCK` rows, and attention is a
loop over the sessions; for the small drafts this is for, both are small
beside what batching saves. With oneDNN-packed weights (``kernels="auto"`` or
``"onednn"``) the first price goes away where the kernel allows it: a packed
weight whose rows come out bitwise the same for any number of rows in the call
(checked once per weight when it is packed,
:func:`specserve.engine.cpu_kernels.fewest_rows`) is
multiplied with the rows as they are (padded to 2 where one row takes another
kernel), so a lone session's step costs one row's matmul, not 16 rows'; a
weight that fails the check keeps the fixed blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from specserve.engine import attention, batching, cpu_kernels
from specserve.engine.cpu_kernels import Kernels

#: Rows per matmul call: every linear layer of a row-invariant pass runs on blocks of this many rows.
ROW_BLOCK = 16
#: The name the row-wise attention function is registered under with transformers.
ATTENTION = "specserve_rowwise"


@dataclass(frozen=True)
class RowLayout:
    """Where each row's keys and real queries are in a batched pass."""

    spans: tuple[
        tuple[int, int], ...
    ]  # row b's keys: cache columns [start, stop), this pass's inputs included
    queries: tuple[int, ...]  # row b's real queries: the first queries[b] input columns
    #: Row b's draft tree in its last real queries (``batching.RowInput.tree``); empty: no row has one.
    trees: tuple[tuple[int, ...] | None, ...] = ()


def _blocked(x: Tensor, matmul: Callable[[Tensor], Tensor]) -> Tensor:
    """``matmul`` of ``x`` ``[..., K]`` computed on row blocks of exactly :data:`ROW_BLOCK` rows -> ``[..., N]``."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.cat(
        [cpu_kernels.pad_rows(block, ROW_BLOCK, matmul) for block in flat.split(ROW_BLOCK)]
    )  # [M, N], the last block zero-padded to ROW_BLOCK rows for its call
    return out.reshape(*x.shape[:-1], out.shape[-1])  # [..., N]


class PackedWeights:
    """A :class:`specserve.engine.cpu_kernels.PackedLinear` for each float32 CPU weight ``F.linear`` is called
    with, made on first use. Where its kernel gives a row the same bits whatever the row count (from
    ``fewest_rows`` rows on) a call costs what its own rows do; otherwise it runs on blocks of
    :data:`ROW_BLOCK` rows (for the same fixed block shape a row's result depends on that row alone, as
    with the stock kernel)."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[Tensor, cpu_kernels.PackedLinear]] = {}  # id(weight) -> (weight, layer)

    def get(self, weight: Tensor, bias: Tensor | None = None) -> cpu_kernels.PackedLinear | None:
        """The packed layer for ``weight`` (and ``bias``), or None where packing does not apply (not float32
        on the CPU)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        hit = self._packed.get(id(weight))
        if hit is None or hit[0] is not weight:  # the weight is kept, so its id is not reused
            hit = (weight, cpu_kernels.PackedLinear(weight, bias))
            self._packed[id(weight)] = hit
        return hit[1]


class RowBlockedMatmuls(TorchFunctionMode):
    """Inside this mode, ``F.linear`` and ``torch.addmm`` run on row blocks of :data:`ROW_BLOCK` rows
    (``F.linear`` on oneDNN-packed weights when ``packed`` is given, unpadded where the packed kernel's
    rows are independent of the row count)."""

    def __init__(self, packed: PackedWeights | None = None) -> None:
        super().__init__()
        self.packed = packed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            x, weight, bias = named["input"], named["weight"], named.get("bias")
            layer = self.packed.get(weight, bias) if self.packed is not None else None
            if layer is None:
                return _blocked(x, lambda block: F.linear(block, weight, bias))
            if layer.fewest_rows is not None:  # a row's bits do not depend on the row count: no blocks
                return layer(x)
            return _blocked(x, layer)
        if func is torch.addmm and not kwargs and len(args) == 3 and args[1].dim() == 2:
            bias, x, weight = args
            return _blocked(x, lambda block: torch.addmm(bias, block, weight))
        return func(*args, **kwargs)


def rowwise_attention(
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

    With a ``row_layout``, row ``b``'s first ``queries[b]`` queries attend to its
    keys ``spans[b]`` (causally, the last query sees them all; a row with a draft tree in ``trees[b]``: each
    node sees the keys before the inputs and its own path, ``batching.input_mask``); padded queries get
    zeros. Without one: transformers' SDPA attention, unchanged.
    """
    if row_layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("row-wise attention does not support attention logit soft-capping")
    batch, heads, queries, _ = query.shape
    if len(row_layout.spans) != batch:
        raise ValueError(f"row layout has {len(row_layout.spans)} rows, the pass {batch}")
    out = query.new_zeros(batch, queries, heads, value.shape[-1])  # [B, T, H, d]
    gqa = heads != key.shape[1]
    for b, ((start, stop), t) in enumerate(zip(row_layout.spans, row_layout.queries, strict=True)):
        n = stop - start
        q = query[b : b + 1, :, :t]  # [1, H, t, d]
        k = key[b : b + 1, :, start:stop]  # [1, KV, n, d]
        v = value[b : b + 1, :, start:stop]  # [1, KV, n, d]
        tree = row_layout.trees[b] if row_layout.trees else None
        if tree is not None:  # the keys before the inputs, then each node's own path among them
            among = batching.input_mask(t, tree).to(query.device)  # [t, t]
            mask = torch.cat([among.new_ones(t, n - t), among], dim=1)  # [t, n]
        else:
            mask = (
                None if t == 1 else torch.ones(t, n, dtype=torch.bool, device=query.device).tril(n - t)
            )  # [t, n]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
        out[b, :t] = o[0].transpose(0, 1)  # [t, H, d]
    return out, None


def prepare(model, *, kernels: Kernels = "stock") -> None:
    """Register :func:`rowwise_attention` with transformers (once) and switch ``model`` to it; with
    ``kernels`` resolving to "onednn" (:func:`specserve.engine.cpu_kernels.resolve`), its row-blocked linears
    run on packed weights."""
    attention.register(ATTENTION, rowwise_attention)
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    weight = next(model.parameters())
    onednn = cpu_kernels.resolve(kernels, weight.device, weight.dtype) == "onednn"
    model._specserve_packed_weights = PackedWeights() if onednn else None


def blocked_matmuls(model) -> RowBlockedMatmuls:
    """The row-blocked matmul mode for ``model`` (prepared by :func:`prepare`): with its packed weights when
    it has them."""
    if model.config._attn_implementation != ATTENTION:
        raise RuntimeError("call row_invariant.prepare(model) before a row-invariant forward pass")
    return RowBlockedMatmuls(getattr(model, "_specserve_packed_weights", None))


def forward(model, packed: batching.PackedBatch) -> tuple[Tensor, object]:
    """:func:`specserve.engine.batching.forward` with row-blocked matmuls and row-wise attention (``model`` prepared)."""
    layout = RowLayout(spans=packed.spans, queries=packed.input_lens, trees=packed.trees)
    with blocked_matmuls(model):
        return batching.forward(model, packed, row_layout=layout)
