"""specserve.engine.attention: grouped heads attended in place give the logits transformers' SDPA gives, bit for bit.

Real tiny Llama models (grouped-query attention: 4 query heads over 2 key/value
heads) in float32 on the CPU, compared with ``torch.equal``: the switch may
change what a pass costs, never a bit of what it computes, so greedy output and
every sampled token stay the target's.
"""

from __future__ import annotations

import pytest
import tiny_models
import torch
from transformers import DynamicCache

from specserve.engine import attention, batching
from specserve.engine.kvcache import SessionCache
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("attention"))
    return target_dir


@pytest.fixture(scope="module")
def pair(target_dir):
    """(the model as the workers load it, the same weights on transformers' SDPA)."""
    grouped = load_model(target_dir, device="cpu", dtype="float32").model
    plain = load_model(target_dir, device="cpu", dtype="float32").model
    plain.set_attn_implementation("sdpa")
    return grouped, plain


def test_the_workers_load_a_grouped_query_model_on_the_cpu_with_it(pair):
    grouped, plain = pair
    config = grouped.config
    assert config.num_key_value_heads < config.num_attention_heads  # the case it is for
    assert grouped.config._attn_implementation == attention.ATTENTION
    assert plain.config._attn_implementation == "sdpa"


def test_a_model_without_grouped_heads_keeps_sdpa(tmp_path):
    gpt2 = load_model(tiny_models.make_tiny_model(tmp_path / "gpt2", arch="gpt2"), device="cpu").model
    assert gpt2.config._attn_implementation == "sdpa"
    assert not attention.use_grouped_sdpa(gpt2)


@pytest.fixture
def in_place(monkeypatch):
    """Whether each SDPA call reads grouped heads in place (``enable_gqa``), in call order."""
    calls = []
    sdpa = attention.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("new", [1, 2, 3, 5, 9])
def test_a_pass_over_new_positions_after_a_cache_is_the_same_bits(pair, new, in_place):
    """The verify pass: ``new`` positions after a cached prefix (masked, so transformers repeats the KV;
    one position has no mask, and transformers reads the grouped heads in place itself)."""
    grouped, plain = pair
    gen = torch.Generator().manual_seed(new)
    prefix = torch.randint(1, grouped.config.vocab_size, (1, 23), generator=gen)
    ids = torch.randint(1, grouped.config.vocab_size, (1, new), generator=gen)
    out = []
    with torch.inference_mode():
        for model in (grouped, plain):
            cache = DynamicCache()
            model(input_ids=prefix, cache=cache, use_cache=True)
            in_place.clear()
            out.append(model(input_ids=ids, cache=cache, use_cache=True).logits)
            # Over several positions transformers copied the KV per query head; the grouped model never did.
            wanted = model is grouped or new == 1
            assert in_place == [wanted] * model.config.num_hidden_layers
    assert torch.equal(out[0], out[1])


def test_a_padded_batch_is_the_same_bits(pair):
    """The target's batched verify pass (:mod:`specserve.engine.batching`): ragged caches and feeds, padded."""
    grouped, plain = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, grouped.config.vocab_size, (n,), generator=gen).tolist() for n in (4, 19, 11)]
    feeds = [(5, 6, 7), (8,), (9, 10, 11, 12, 13)]
    logits = []
    for model in (grouped, plain):
        rows = []
        for i, prompt in enumerate(prompts):
            cache = SessionCache(model, f"s{i}")
            cache.extend(prompt)
            rows.append(
                batching.RowInput(
                    past=tuple(cache.layer_kv()), past_len=cache.seq_len, input_ids=feeds[i], logits_needed=len(feeds[i])
                )
            )
        packed = batching.pack(rows, config=model.config, device="cpu")
        out, _ = batching.forward(model, packed)
        logits.append([batching.row_logits(out, packed, b) for b in range(len(rows))])
    for b, (g, p) in enumerate(zip(*logits, strict=True)):
        assert torch.equal(g, p), f"row {b}: max diff {(g - p).abs().max()}"


def test_greedy_generation_is_token_identical(pair):
    grouped, plain = pair
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    runs = [
        model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
        for model in (grouped, plain)
    ]
    assert torch.equal(runs[0], runs[1])
