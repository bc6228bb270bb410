"""The round loop end to end: real Redis, real gRPC target/draft/coordinator servers, tiny float32 models.

* Greedy equality: for several prompts, gamma in {1, 2, 4, 8} and automatic, and
  both proposers, the streamed ids equal the target's own ``generate(do_sample=False)``.
* The stream is the log: every finished session's streamed tokens are the Redis
  log after the prompt, in order, none twice; the stats account for every round.
"""

from __future__ import annotations

import asyncio

import pytest
import system_fixtures as sf

from specserve.runtime.store import SessionStore
from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS_TEXT = ("def add(a, b):\n", "for i in range(10):\n    print", "the quick brown")
MAX_NEW = 24
MODEL = common_pb2.PROPOSER_KIND_MODEL
NGRAM = common_pb2.PROPOSER_KIND_NGRAM


@pytest.fixture(scope="module")
def prompts(pair):
    tok = pair.tokenizer
    return [tok.encode(t, add_special_tokens=False) for t in PROMPTS_TEXT]


@pytest.fixture(scope="module")
def expected(pair, prompts):
    return [sf.reference_greedy(pair.target_dir, p, MAX_NEW) for p in prompts]


async def assert_stream_is_log(store: SessionStore, out: sf.Generated) -> None:
    assert out.stats is not None, "the stream must end with GenerationStats"
    record = await store.load(out.stats.session_id)
    assert list(record.generated_token_ids) == out.token_ids
    assert record.finished and record.finish_reason == out.stats.finish_reason
    assert out.stats.completion_tokens == len(out.token_ids)
    assert out.stats.prompt_tokens == record.prompt_len
    assert record.version == out.stats.rounds  # one commit per round, none lost or doubled
    assert all(chunk.token_ids for chunk in out.chunks[:-1])


@pytest.mark.parametrize("proposer", [MODEL, NGRAM], ids=["model", "ngram"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8, None], ids=["g1", "g2", "g4", "g8", "auto"])
async def test_greedy_equals_target_generate(stack, store, prompts, expected, gamma, proposer):
    outs = await asyncio.gather(
        *(
            sf.generate(stack.address, sf.request(p, max_new_tokens=MAX_NEW, gamma=gamma, proposer=proposer))
            for p in prompts
        )
    )
    for out, want in zip(outs, expected, strict=True):
        assert out.token_ids == want
        await assert_stream_is_log(store, out)
    stats = [o.stats for o in outs]
    if gamma is not None:
        # A fixed gamma is proposed every round (capped by the tokens left) unless the draft failed.
        assert sum(s.proposed_tokens for s in stats) > 0
    for s in stats:
        assert s.accepted_tokens <= s.proposed_tokens
        assert sum(s.accepted_per_position) == s.accepted_tokens
        assert s.rounds >= 1 and s.total_ns >= s.first_token_ns > 0


async def test_model_proposer_is_accepted_sometimes(stack, prompts, expected):
    """The draft shares its tokenizer with the target; with a draft equal to the target
    acceptance would be total, with these different random weights it is partial but the
    proposals must at least reach the target (proposed > 0) and the output stay exact."""
    out = await sf.generate(stack.address, sf.request(prompts[0], max_new_tokens=MAX_NEW, gamma=4))
    assert out.token_ids == expected[0]
    assert out.stats.proposed_tokens >= 4


@pytest.mark.parametrize("draft_top_k", [0, 5], ids=["dense", "sparse-top5"])
async def test_sampled_generation_is_reproducible_by_seed_and_is_the_log(stack, store, prompts, draft_top_k):
    """The same seed with the same (fixed) speculation schedule reproduces the same tokens; a
    different seed gives a different sample; every stream equals its Redis log."""

    def req(seed):
        return sf.request(
            prompts[1],
            max_new_tokens=MAX_NEW,
            temperature=1.0,
            seed=seed,
            gamma=3,
            draft_top_k=draft_top_k,
            ignore_eos=True,
        )

    a, b, c = await asyncio.gather(*(sf.generate(stack.address, req(seed)) for seed in (42, 42, 43)))
    assert a.token_ids == b.token_ids and len(a.token_ids) == MAX_NEW
    assert c.token_ids != a.token_ids
    assert a.stats.seed == 42 and a.stats.proposed_tokens > 0
    for out in (a, b, c):
        await assert_stream_is_log(store, out)


async def test_gamma_zero_rounds_decode_several_target_steps_per_call(stack, store, prompts, expected):
    """At gamma 0 the first round (the prefill) sends its token alone, every later round asks the target for
    decode_steps (4, the default) steps in one Verify call: greedy output is still the target's own, and
    each round is still one commit, so 24 tokens take 1 + ceil(23 / 4) = 7 rounds instead of 24."""
    out = await sf.generate(stack.address, sf.request(prompts[0], max_new_tokens=MAX_NEW, gamma=0))
    assert out.token_ids == expected[0]
    await assert_stream_is_log(store, out)
    assert out.stats.rounds == 1 + -(-(MAX_NEW - 1) // 4)
    assert [len(c.token_ids) for c in out.chunks][:2] == [1, 4]
    assert out.stats.proposed_tokens == 0
