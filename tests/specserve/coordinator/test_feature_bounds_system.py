"""Bounded features through the whole system (issue 54, finding 4; docs/design.md, "The feature head").

Every role's gRPC messages are limited to 32 KiB, and one prompt near the tiny target's 512-position
context has more feature bytes than that (439 rows of 96 bytes). Three such prompts run at once with the head
as proposer, at gamma 0, at gamma 4 and at the default (adaptive) gamma: the target's replies and the
coordinator's Propose calls carry the rows in bounded pieces over several rounds
(``features_per_call_bytes``), so no call fails for them; every session completes, token-identical to stock
transformers ``generate()``, and each one at gamma 4 drafts with the head once its features are all there.

Real Redis, real gRPC servers, the tiny float32 pair and a tiny head trained on these prompts.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch

from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

LIMIT = 32 * 1024  # every role's max_message_bytes
PROMPT_LEN = 440
MAX_NEW = 64  # 504 of the 512 positions


CASES = {"gamma0": 0, "gamma4": 4, "default": None}


@pytest.fixture(scope="module")
def prompts(pair) -> dict[str, list[list[int]]]:
    """Per case, three random prompts (their own: none in another's prefix cache) whose greedy continuations
    hold no end-of-sequence within MAX_NEW tokens."""
    found = []
    for seed in range(200):
        prompt = torch.randint(1, 384, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
        if len(sf.reference_greedy(pair.target_dir, prompt, MAX_NEW)) == MAX_NEW:
            found.append(prompt)
        if len(found) == 3 * len(CASES):
            return {case: found[3 * i : 3 * i + 3] for i, case in enumerate(CASES)}
    raise AssertionError("too few prompts without an early end-of-sequence")


@pytest.fixture(scope="module")
def head_dir(pair, prompts, tmp_path_factory):
    return sf.tiny_head(pair, tmp_path_factory, [p for case in prompts.values() for p in case], length=MAX_NEW)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, head_dir, redis_server):
    async with sf.local_stack(
        pair,
        redis_server.url,
        worker_overrides={"max_message_bytes": LIMIT},
        target_overrides={"features_per_call_bytes": LIMIT // 2},
        draft_overrides=sf.head_overrides(pair, head_dir),
        coordinator_overrides={
            "max_message_bytes": LIMIT,
            "features_per_call_bytes": LIMIT // 2,
            "default_proposer": "auto",
        },
    ) as s:
        yield s


@pytest.mark.parametrize("case", list(CASES))
async def test_three_long_prompts_complete_exact_and_draft_with_the_head_once_their_features_arrive(
    stack, pair, prompts, case
):
    """At gamma 0, at a fixed gamma and at the default (the adaptive policy, which may keep a session at
    gamma 0 where drafting does not pay: that is its choice, not the features'), every session completes
    and is exact; at a fixed gamma each drafts with the head, accepted, once its features arrive."""
    gamma, prompts = CASES[case], prompts[case]
    hidden = json.loads((pair.target_dir / "config.json").read_text())["hidden_size"]
    assert (PROMPT_LEN - 1) * hidden * 2 > LIMIT  # unbounded, one prompt's features alone would not fit
    outs = await asyncio.gather(
        *(
            sf.generate(
                stack.address,
                sf.request(prompt, max_new_tokens=MAX_NEW, gamma=gamma, proposer=common_pb2.PROPOSER_KIND_UNSPECIFIED),
                timeout_s=120.0,
            )
            for prompt in prompts
        )
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW)
        assert out.stats.proposer == common_pb2.PROPOSER_KIND_FEATURE
        assert out.stats.cached_tokens == 0  # every row of the prompt's features had to travel
        if gamma:  # not at gamma 0 for its whole life: the head drafts, and is accepted
            assert out.stats.proposed_tokens > 0 and out.stats.accepted_tokens > 0, out.stats
        elif gamma == 0:
            assert out.stats.proposed_tokens == 0
