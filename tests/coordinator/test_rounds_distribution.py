"""Distribution end to end: speculative sampling through the whole system is target-only sampling.

A target and a draft with a 4-token vocabulary (EOS is an ordinary token here:
``ignore_eos``), different weights (total variation between their 3-token
joints is about 0.5, so the draft alone is far from the target). N = 480
sessions per setting, seeds 0..N-1, gamma = 2 (rounds accept, reject at the
first or second position, and take bonus tokens), each generating 3 tokens
through the real coordinator, draft and target servers and Redis. The
empirical joint distribution of the 3 tokens is compared with the target's
exact joint, computed by enumerating all 4^3 continuations with the target
model and ``specserve.sampling.logits_to_probs`` (the same processing).

Test: Pearson chi-square goodness of fit, cells with expected count < 5 merged
(smallest first) into one cell, significance level 0.001. A sample outside the
target's support (a token top-k / top-p removed) fails at once. With N = 480, a
system that returned the draft's tokens (TV ~0.5) or skipped the residual
correction has chi-square in the hundreds (p < 1e-20). The seeds are fixed and
the randomness is counter-based, so the outcome is reproducible.
Settings: temperature 1; temperature 0.8 with top-k 3 and top-p 0.9 together.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import pytest_asyncio
import system_fixtures as sf
from scipy.stats import chisquare

from specserve.params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

VOCAB = 4
PROMPT = (1, 2, 3, 1)
LENGTH = 3
N = 480
ALPHA = 0.001
CONCURRENCY = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_vocab_pair(tmp_path_factory, vocab_size=VOCAB)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides={"max_batch_size": 32}) as s:
        yield s


def merged_chi_square(observed: Counter, expected_p: dict) -> tuple[float, float, int]:
    """Chi-square statistic, p-value and number of cells after merging cells with expected < 5."""
    n = sum(observed.values())
    cells = sorted(expected_p, key=lambda k: expected_p[k])
    obs, exp = [], []
    acc_o = acc_e = 0.0
    for key in cells:
        acc_o += observed.get(key, 0)
        acc_e += expected_p[key] * n
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # leftover small mass joins the last merged cell
        obs[-1] += acc_o
        exp[-1] += acc_e
    stat, p = chisquare(obs, exp)
    return float(stat), float(p), len(obs)


async def _sample(stack, **sampling) -> Counter:
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(seed: int) -> tuple[int, ...]:
        async with sem:
            req = sf.request(PROMPT, max_new_tokens=LENGTH, seed=seed, gamma=2, ignore_eos=True, **sampling)
            out = await sf.generate(stack.address, req)
            assert out.stats.seed == seed
            return tuple(out.token_ids)

    return Counter(await asyncio.gather(*(one(seed) for seed in range(N))))


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 3, "top_p": 0.9}],
    ids=["t1", "t0.8-k3-p0.9"],
)
async def test_joint_of_three_tokens_matches_target_only_sampling(stack, pair, sampling):
    params = SamplingParams(
        temperature=sampling["temperature"], top_k=sampling.get("top_k", 0), top_p=sampling.get("top_p", 1.0)
    )
    exact = sf.exact_joint(pair.target_dir, PROMPT, params, LENGTH)
    observed = await _sample(stack, **sampling)
    assert sum(observed.values()) == N
    outside = [seq for seq in observed if seq not in exact]
    assert not outside, f"sampled sequences the target gives probability 0: {outside}"
    stat, p, cells = merged_chi_square(observed, exact)
    print(f"chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"
    # The draft's own joint must be rejected by the same test (the test has power).
    draft_exact = sf.exact_joint(pair.draft_dir, PROMPT, params, LENGTH)
    draft_like = Counter({k: round(v * N) for k, v in draft_exact.items() if k in exact})
    assert merged_chi_square(draft_like, exact)[1] < ALPHA
