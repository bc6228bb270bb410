"""Predicted Outputs through the whole system (coordinator, draft and target servers on loopback, a real Redis,
tiny float32 models): the prediction is drafted in the coordinator and verified exactly like any proposal, so
greedy output is the target's own whatever the prediction; a right prediction is accepted almost whole, a
half-wrong one is counted as rejected where it is wrong; in the coupled sampling mode it changes nothing but
speed."""

from __future__ import annotations

import pytest
import system_fixtures as sf

from specserve import AsyncClient
from specserve.api.errors import InvalidArgument
from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = ("def add(a, b):\n", "for i in range(10):\n    print", "class Point:\n    def")
MAX_NEW = 48


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def greedy(pair, prompts):
    return [sf.reference_greedy(pair.target_dir, p, MAX_NEW, ignore_eos=True) for p in prompts]


def half_wrong(tokens: list[int]) -> list[int]:
    """Every other run of eight tokens replaced by other tokens: half of the prediction is wrong."""
    return [(t + 1) % 384 if (i // 8) % 2 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("gamma", [None, 8], ids=["adaptive", "gamma8"])
async def test_a_right_prediction_is_accepted_whole_and_changes_nothing(stack, prompts, greedy, gamma):
    async with AsyncClient(stack.address) as client:
        for prompt, want in zip(prompts, greedy, strict=True):
            kw = {"prompt_token_ids": prompt, "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
            plain = await client.generate(gamma=0, **kw)
            result = await client.generate(gamma=gamma, prediction=want, **kw)
            assert list(result.token_ids) == list(plain.token_ids) == want
            stats = result.stats
            assert stats.accepted_prediction_tokens >= 0.9 * stats.completion_tokens
            assert stats.rejected_prediction_tokens == 0
            assert stats.accepted_tokens >= 0.75 * stats.completion_tokens, "drafted and accepted, in long rounds"
            assert stats.rounds <= stats.completion_tokens // 3


async def test_a_half_wrong_prediction_changes_nothing_and_its_rejections_are_counted(stack, prompts, greedy):
    async with AsyncClient(stack.address) as client:
        for prompt, want in zip(prompts, greedy, strict=True):
            result = await client.generate(
                prompt_token_ids=prompt,
                max_new_tokens=MAX_NEW,
                temperature=0,
                ignore_eos=True,
                prediction=half_wrong(want),
                gamma=4,  # the counting under test, not the policy (which may park at 0 on a loaded machine)
            )
            assert list(result.token_ids) == want
            stats = result.stats
            assert stats.rejected_prediction_tokens > 0
            assert 0 < stats.accepted_prediction_tokens < stats.completion_tokens
            assert stats.accepted_prediction_tokens >= 0.3 * stats.completion_tokens, "re-aligned after each miss"


async def test_predictions_are_drafted_in_the_coordinator_with_no_draft_tier(pair, redis_server, prompts, greedy):
    """No draft replica at all: the prediction drafts alone (where it has nothing, the round is gamma 0, or the
    n-gram lookup drafts); the output is the target's own."""
    # One target step per round: with these tiny models a round trip costs several target steps, so at the
    # default decode_steps the policy rightly prefers four target steps per call to a half-wrong prediction.
    one_step = {"decode_steps": 1}
    async with sf.local_stack(pair, redis_server.url, with_draft=False, coordinator_overrides=one_step) as stack:
        async with AsyncClient(stack.address) as client:
            for proposer in ("model", "ngram"):
                result = await client.generate(
                    prompt_token_ids=prompts[0],
                    max_new_tokens=MAX_NEW,
                    temperature=0,
                    ignore_eos=True,
                    prediction=half_wrong(greedy[0]),
                    proposer=proposer,
                )
                assert list(result.token_ids) == greedy[0]
                assert result.stats.accepted_prediction_tokens > 0 and result.stats.accepted_tokens > 0


async def test_in_the_coupled_mode_a_prediction_changes_no_token(stack, prompts):
    """Drafter invariance: a sampled request in the coupled mode gives the same tokens with a prediction (right,
    half wrong, unrelated) as without one, at a fixed seed."""
    kw = {
        "prompt_token_ids": prompts[1],
        "max_new_tokens": 32,
        "temperature": 0.9,
        "seed": 3,
        "ignore_eos": True,
        "sampling_mode": "coupled",
    }
    async with AsyncClient(stack.address) as client:
        plain = await client.generate(gamma=0, **kw)
        want = list(plain.token_ids)
        for prediction in (want, half_wrong(want), [7, 8, 9] * 10):
            result = await client.generate(prediction=prediction, **kw)
            assert list(result.token_ids) == want
        assert result.stats.accepted_prediction_tokens == 0  # the unrelated one


async def test_a_text_prediction_is_tokenized_once_and_bad_ones_are_refused(stack, pair, prompts, greedy):
    text = pair.tokenizer.decode(greedy[0])
    async with AsyncClient(stack.address) as client:
        result = await client.generate(
            prompt_token_ids=prompts[0], max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, prediction=text
        )
        assert list(result.token_ids) == greedy[0]
        assert result.stats.accepted_prediction_tokens > 0
        with pytest.raises(InvalidArgument, match="prediction token id"):
            await client.generate(prompt_token_ids=prompts[0], max_new_tokens=4, prediction=[1, 100_000])
        too_long = stack.coordinator.coordinator.settings.max_prompt_tokens + 1
        with pytest.raises(InvalidArgument, match="prediction has"):
            await client.generate(prompt_token_ids=prompts[0], max_new_tokens=4, prediction=[5] * too_long)
    req = sf.request(prompts[0], max_new_tokens=8, proposer=common_pb2.PROPOSER_KIND_MODEL)
    req.prediction.text = ""
    out = await sf.generate(stack.address, req)
    assert out.stats.accepted_prediction_tokens == 0 and len(out.token_ids) > 0
