"""Attention for passes over several new positions on a CPU: grouped heads attended in place.

A model with grouped-query attention (fewer key/value heads than query heads,
as the default target, SmolLM2-135M: 9 query heads over 3 key/value heads)
goes through transformers' SDPA attention. Over one new position, or with no
mask, transformers lets ``scaled_dot_product_attention`` read each key/value
head for its group of query heads (``enable_gqa``). Over several new positions
with a mask, which is every verify pass (the proposal's positions after the
cached prefix) and every prefill after the first, it copies each key/value
head once per query head of its group first (``repeat_kv``): on a CPU that
copy of the whole cache costs about as much as the attention itself.

:func:`grouped_sdpa` is transformers' SDPA attention with that case sent to
``scaled_dot_product_attention(..., enable_gqa=True)`` on a CPU. On a CPU the
kernel computes each query head from its group's key/value head exactly as from
the copy, so the logits are the same bits (``tests/specserve/engine/test_attention.py``
checks a whole pass); only the copy is saved. Every other case (one new
position, no mask, a GPU, where transformers avoids masked GQA because the fast
kernels refuse it, position biases) is transformers' own function, unchanged.

:func:`use_grouped_sdpa` switches a model on the CPU to it (the workers'
``load_model`` and the benchmark's HF baselines alike, so that ratios compare
like with like). Measured on the default target: docs/benchmarks/attention.md
(``python -m benchmarks attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The name :func:`grouped_sdpa` is registered under with transformers.
ATTENTION = "specserve_grouped_sdpa"


def grouped_sdpa(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query [B, H, T, d]``, ``key/value [B, KV, W, d]`` -> ``[B, T, H, d]``.

    A masked pass over ``T > 1`` positions with grouped heads on a CPU: SDPA with ``enable_gqa``.
    Anything else: transformers' SDPA attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    if (
        query.device.type != "cpu"
        or groups <= 1
        or q_length == 1
        or attention_mask is None
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # With a mask transformers passes is_causal=False: the mask says everything.
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, H, T, d]
    return out.transpose(1, 2).contiguous(), None


def register(name: str, function) -> None:
    """Register an attention ``function`` with transformers under ``name`` (once), with SDPA's mask: how
    this package's attention functions (:func:`grouped_sdpa`, ``row_invariant.rowwise_attention``) are
    made selectable with ``set_attn_implementation(name)``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, function)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def use_grouped_sdpa(model) -> bool:
    """Switch ``model`` to :func:`grouped_sdpa` where it changes something: SDPA attention, on the CPU,
    with grouped heads. Returns whether it did."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    on_cpu = next(model.parameters()).device.type == "cpu"
    if model.config._attn_implementation != "sdpa" or not on_cpu or not heads or kv_heads >= heads:
        return False
    register(ATTENTION, grouped_sdpa)
    model.set_attn_implementation(ATTENTION)
    return True
