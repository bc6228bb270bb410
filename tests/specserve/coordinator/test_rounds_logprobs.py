"""Logprobs through the whole system (coordinator, draft and target servers on loopback, a real Redis, tiny
float32 models) with the gRPC SDK: every emitted token's logprob is the log of the target's processed
probability at its position, checked against Hugging Face's processors to 1e-4, for greedy and sampled
requests in both sampling modes, with speculation on (draft tokens accepted, not only bonus tokens), and
across a target failover."""

from __future__ import annotations

import pytest
import pytest_asyncio
import system_fixtures as sf

from specserve import AsyncClient
from specserve.api.errors import InvalidArgument

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = "class Point:\n    def __init__(self, x, y):\n"
MAX_NEW = 24
TOP = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt(pair):
    return pair.tokenizer.encode(TEXT, add_special_tokens=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    # One target step per round: with these tiny models a round trip costs several target steps, so at the
    # default decode_steps the policy rightly prefers four target steps per call to drafting from a
    # prediction right five tokens in six, and these tests are about drafted tokens' logprobs.
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides={"decode_steps": 1}) as s:
        yield s


def partly_wrong(tokens: list[int], vocab_size: int = 384) -> list[int]:
    """``tokens`` with every sixth one replaced: a prediction that is accepted in runs and then rejected."""
    return [(t + 1) % vocab_size if i % 6 == 5 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["greedy", "greedy+penalty"])
async def test_greedy_logprobs_equal_hf_with_drafted_tokens_accepted(stack, pair, prompt, penalty):
    """Drafted tokens come from a prediction that is right five tokens in six, so rounds accept several
    drafted tokens and end in a correction; the model draft runs as well where the prediction is lost."""
    want = sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True, repetition_penalty=penalty)
    kw = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "repetition_penalty": penalty}
    async with AsyncClient(stack.address) as client:
        result = await client.generate(
            prompt_token_ids=prompt, logprobs=True, top_logprobs=TOP, prediction=partly_wrong(want), **kw
        )
        model_only = await client.generate(prompt_token_ids=prompt, gamma=4, logprobs=True, top_logprobs=TOP, **kw)
    assert list(result.token_ids) == want == list(model_only.token_ids)
    assert result.stats.accepted_tokens >= MAX_NEW // 3, "drafted tokens were accepted, not only bonus tokens"
    assert result.stats.rejected_prediction_tokens > 0, "and some rejected: corrections carry logprobs too"
    reference = sf.reference_logprobs(pair.target_dir, prompt, want, repetition_penalty=penalty)
    sf.check_logprobs(result.logprobs, want, reference, TOP)
    sf.check_logprobs(model_only.logprobs, want, reference, TOP)


@pytest.mark.parametrize(
    ("sampling", "mode"),
    [
        ({"temperature": 0.9, "top_k": 40, "repetition_penalty": 1.1}, "optimal"),
        ({"temperature": 1.2, "top_p": 0.9}, "coupled"),
    ],
    ids=["optimal", "coupled"],
)
async def test_sampled_logprobs_equal_hf_at_every_emitted_token(stack, pair, prompt, sampling, mode):
    async with AsyncClient(stack.address) as client:
        result = await client.generate(
            prompt_token_ids=prompt,
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            gamma=4,
            seed=21,
            sampling_mode=mode,
            logprobs=True,
            top_logprobs=TOP,
            **sampling,
        )
    assert len(result.token_ids) == MAX_NEW and result.stats.accepted_tokens > 0
    reference = sf.reference_logprobs(pair.target_dir, prompt, result.token_ids, **sampling)
    sf.check_logprobs(result.logprobs, result.token_ids, reference, TOP)
    if "top_k" in sampling:
        assert all(len(e.top_logprobs) == TOP for e in result.logprobs)


async def test_streamed_chunks_carry_the_logprobs_of_their_tokens_and_none_unless_asked(stack, prompt):
    async with AsyncClient(stack.address) as client:
        async with client.stream(
            prompt_token_ids=prompt, max_new_tokens=12, temperature=0, gamma=2, ignore_eos=True, logprobs=True
        ) as stream:
            chunks = [c async for c in stream]
        plain = await client.generate(prompt_token_ids=prompt, max_new_tokens=12, temperature=0, ignore_eos=True)
        with pytest.raises(InvalidArgument, match="top_logprobs must be in"):
            await client.generate(prompt_token_ids=prompt, max_new_tokens=2, logprobs=True, top_logprobs=21)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [e.token_id for c in chunks for e in c.logprobs] == list(stream.result.token_ids)
    assert all(e.top_logprobs == () for e in stream.result.logprobs), "top_logprobs 0: the token alone"
    assert plain.logprobs == () and stream.result.token_ids == plain.token_ids


async def test_logprobs_survive_a_target_failover(pair, redis_server, prompt):
    """Two target replicas; the one holding the session is stopped after the first tokens: the session moves,
    the new replica rebuilds it from Redis, and every token's logprobs still equal the reference."""
    want = sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
    async with sf.local_stack(pair, redis_server.url, n_targets=2) as stack:
        before = [set(t.caches.session_ids()) for t in stack.targets]
        async with AsyncClient(stack.address) as client:
            async with client.stream(
                prompt_token_ids=prompt,
                max_new_tokens=MAX_NEW,
                temperature=0,
                gamma=2,
                ignore_eos=True,
                logprobs=True,
                top_logprobs=TOP,
            ) as stream:
                chunks = [await stream.__anext__()]
                holders = [i for i, t in enumerate(stack.targets) if set(t.caches.session_ids()) - before[i]]
                assert len(holders) == 1
                await stack.stop_target(holders[0])
                chunks += [c async for c in stream]
        received = [t for c in chunks for t in c.token_ids]
        assert len(chunks[0].token_ids) < MAX_NEW, "the replica must stop in the middle of the generation"
        assert received == want
        sf.check_logprobs(stream.result.logprobs, want, sf.reference_logprobs(pair.target_dir, prompt, want), TOP)
        pool = stack.coordinator.coordinator.pool
        assert pool.targets.failures(f"127.0.0.1:{stack.target_ports[holders[0]]}") >= 1
