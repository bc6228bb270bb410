"""Greedy output through the whole system is stock Hugging Face ``generate()``'s, token for token, however it is
served: alone or batched with seven others, at gamma 0, 1 and 4, on the target's default settings (kernels
"auto", the passes not invariant) and with invariant passes (``--invariant``).

Real Redis, real gRPC target/draft/coordinator servers, the tiny float32 pair, and as the reference the
target loaded by plain transformers (stock kernels and attention: code this project did not write).

A note on scale: the tiny target's logits are spread wide (``tiny_models`` initialises its weights wider
than usual so that greedy tests are not decided by near-ties), so a difference of a few ulps between two ways
of computing a position rarely flips its argmax here; this test shows the system's plumbing keeps greedy
output exact. That the bits themselves do not move with the pass width, the prefill, the batch-mates or the
replica is shown bit for bit by the property test, ``tests/specserve/engine/test_position_invariant.py``,
on a model with the default target's attention shapes.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from prometheus_client import REGISTRY

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_NEW = 24
PROMPTS = 8  # one batch: each prompt beside the seven others


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["default", "invariant"])
async def stack(pair, redis_server, request):
    """The system with the target's default pass settings (the fixture's usual stock kernels overridden), and
    with invariant passes."""
    target = {"kernels": "auto", "invariant": request.param == "invariant"}
    async with sf.local_stack(pair, redis_server.url, target_overrides=target) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(pair):
    """Held-out prompts: random token ids of different lengths (1 to 150 tokens), so batch-mates pad."""
    gen = torch.Generator().manual_seed(43)
    vocab = len(pair.tokenizer)
    lengths = [1, 5, 17, 40, 63, 64, 101, 150]
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths[:PROMPTS]]


@pytest.fixture(scope="module")
def expected(pair, prompts):
    return [sf.reference_greedy(pair.target_dir, p, MAX_NEW, ignore_eos=True) for p in prompts]


def _batched_verifies() -> float:
    """Sessions verified beside another session so far: the sum of the batch sizes minus the calls."""
    count = REGISTRY.get_sample_value("specserve_coordinator_verify_batch_size_count") or 0.0
    total = REGISTRY.get_sample_value("specserve_coordinator_verify_batch_size_sum") or 0.0
    return total - count


@pytest.mark.parametrize("gamma", [0, 1, 4])
async def test_alone_greedy_is_stock_generate(stack, prompts, expected, gamma):
    for prompt, want in zip(prompts, expected, strict=True):
        out = await sf.generate(
            stack.address, sf.request(prompt, max_new_tokens=MAX_NEW, gamma=gamma, ignore_eos=True)
        )
        assert out.token_ids == want, (len(prompt), gamma)


@pytest.mark.parametrize("gamma", [0, 1, 4])
async def test_batched_with_seven_others_greedy_is_stock_generate(stack, prompts, expected, gamma):
    before = _batched_verifies()
    outs = await asyncio.gather(
        *(
            sf.generate(stack.address, sf.request(p, max_new_tokens=MAX_NEW, gamma=gamma, ignore_eos=True))
            for p in prompts
        )
    )
    for prompt, out, want in zip(prompts, outs, expected, strict=True):
        assert out.token_ids == want, (len(prompt), gamma)
    assert _batched_verifies() > before, "no Verify call held more than one session"
