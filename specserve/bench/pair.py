"""The draft/target pair in this process, without the serving stack.

Shared by the benchmark harness (its Hugging Face baselines and model costs,
:mod:`specserve.bench.costs`) and the experiments in benchmarks/: loading the pair in float32,
one forward pass with a KV cache, a cache prefilled with a prompt, and Hugging Face ``generate()`` timed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import specserve.engine.draft_model  # noqa: F401  (registers the default draft's model type)
from specserve.bench.timing import Stopwatch
from specserve.engine import attention, cpu_kernels
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.models import pass_timer


def load_pair(target_dir: str | Path, draft_dir: str | Path, dtype=torch.float32, kernels: Kernels = "stock"):
    """``(tokenizer, target, draft)`` from local directories, in eval mode; the vocabularies must agree.

    The linear layers of both take the ``kernels`` path (:mod:`specserve.engine.cpu_kernels`), as the workers'
    do (the draft service's drafting passes run their row-blocked linears on packed weights), and their
    attention is the workers' (:func:`specserve.engine.attention.use_grouped_sdpa`).
    """
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    dtok = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    if tok.get_vocab() != dtok.get_vocab():
        raise ValueError("draft and target vocabularies differ")
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, local_files_only=True, dtype=dtype).eval()
    if cpu_kernels.resolve(kernels, target.device, dtype) == "onednn":
        if kernels == "fastest":  # the target service's default: both paths timed, the faster kept
            cpu_kernels.use_faster_linears(target, pass_timer(target, target.device))
        else:
            cpu_kernels.use_packed_linears(target)
        cpu_kernels.use_packed_linears(draft)  # the draft service's default (auto)
    for model in (target, draft):  # the workers' attention (specserve.engine.models.load_model)
        attention.use_grouped_sdpa(model)
    return tok, target, draft


def ignore_eos(model) -> dict:
    """``generate()`` arguments for specserve's ``ignore_eos``: EOS is an ordinary token, generated where
    the model picks it, and nothing stops there. An id no token has does that (``min_new_tokens`` would
    forbid EOS instead, another distribution)."""
    return {"eos_token_id": model.config.vocab_size + 1, "pad_token_id": model.config.eos_token_id}


def hf_generate(
    model, ids: Sequence[int], max_new: int, temperature: float = 0.0, seed: int = 0, **extra
) -> tuple[list[int], float]:
    """One Hugging Face ``generate()`` of exactly ``max_new`` tokens (EOS ignored, as specserve's
    ``ignore_eos`` runs): greedy at ``temperature`` 0, else sampled at that temperature with nothing else (no
    top-k, no top-p), as the specserve requests are; ``extra``: more ``generate()`` arguments
    (``assistant_model``, ``prompt_lookup_num_tokens``). The new tokens and the seconds it took."""
    x = torch.tensor([list(ids)])
    kwargs = {"max_new_tokens": max_new, "do_sample": temperature > 0, **ignore_eos(model), **extra}
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    torch.manual_seed(seed)
    with Stopwatch() as sw, torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    return out[0, x.shape[1] :].tolist(), sw.seconds


def forward(model, ids: Sequence[int], cache: DynamicCache) -> torch.Tensor:
    """Feed ``ids`` after what ``cache`` holds (growing it); ``[len(ids), vocab]`` next-token logits."""
    return model(input_ids=torch.tensor([list(ids)]), cache=cache, use_cache=True).logits[0]


def prefilled(model, ids: Sequence[int]) -> DynamicCache:
    """A new cache holding ``ids``."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        forward(model, ids, cache)
    return cache
