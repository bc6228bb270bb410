"""The prefix cache under memory pressure through one worker (docs/operations.md, "Sizing the prefix cache").

200 distinct 64-token prompts go through a stack whose target and draft each have a KV budget for 20 of
them: after every request the target's KV bytes are within the budget, no request fails, blocks are
evicted (counted), the 20 most recent prompts are found again whole (hits counted) and the oldest are
not. The same run at full size (1,000 distinct 1,000-token prefixes, a budget for 100) is
``python -m benchmarks prefix-cache-memory`` (docs/benchmarks/prefix-cache.md).

Real Redis, real gRPC servers, the tiny float32 pair.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from prometheus_client import REGISTRY

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = 200
TOKENS = 64  # 4 blocks of 16: the last, partial-free block never shared (one token left to feed)
KEEP = 20  # prompts the budget holds
BLOCK = 16


def _kv_bytes_per_token(pair) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(pair.target_dir)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * kv_heads * head_dim * 2 * 4  # keys and values, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small(tiny, redis_server):
    pair = tiny
    budget = KEEP * TOKENS * _kv_bytes_per_token(pair)
    async with sf.local_stack(pair, redis_server.url, worker_overrides={"kv_budget_bytes": budget}) as s:
        yield s, budget


def _prompt(i: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (TOKENS,), generator=torch.Generator().manual_seed(50_000 + i)).tolist()


def _target_bytes() -> float:
    return REGISTRY.get_sample_value("specserve_worker_kv_cache_bytes", {"role": "target"}) or 0.0


async def test_many_prefixes_through_a_budget_for_a_tenth_of_them(small, tiny):
    stack, budget = small
    pair = tiny
    vocab = len(pair.tokenizer)
    store = stack.targets[0].caches
    evicted_before = store.stats.blocks_evicted
    most = 0.0
    for i in range(PROMPTS):
        reply = await sf.generate(stack.address, sf.request(_prompt(i, vocab), max_new_tokens=2, gamma=0))
        assert reply.stats is not None and reply.stats.completion_tokens >= 1
        most = max(most, _target_bytes())
        assert _target_bytes() <= budget
    assert store.stats.blocks_evicted - evicted_before >= (PROMPTS - KEEP) * (TOKENS // BLOCK - 1)
    # The most recent prompts are held whole (their 3 blocks before the last token), the oldest are gone.
    hits = store.stats.hits
    recent = await sf.generate(
        stack.address, sf.request(_prompt(PROMPTS - 1, vocab), max_new_tokens=1, gamma=0)
    )
    assert recent.stats.cached_tokens == (TOKENS - 1) // BLOCK * BLOCK
    oldest = await sf.generate(stack.address, sf.request(_prompt(0, vocab), max_new_tokens=1, gamma=0))
    assert oldest.stats.cached_tokens == 0
    assert store.stats.hits - hits == recent.stats.cached_tokens
    print(
        f"\ntarget KV bytes at most {most:.0f} of a {budget} budget; blocks evicted {store.stats.blocks_evicted}"
    )
