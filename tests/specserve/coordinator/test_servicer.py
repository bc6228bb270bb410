"""Bad Generate requests get INVALID_ARGUMENT with a message that says what to fix, and the
server keeps serving others (real coordinator, target and draft servers on loopback)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf

from specserve.v1 import common_pb2, coordinator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMITS = {"max_prompt_tokens": 16, "max_new_tokens_limit": 32, "default_max_new_tokens": 8}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=LIMITS) as s:
        yield s


def _no_prompt():
    return coordinator_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(temperature=0))


def _with(req, mutate):
    mutate(req)
    return req


def _constrained(**kind) -> coordinator_pb2.GenerateRequest:
    """A request under a constraint (``Constraint`` fields, e.g. ``regex="a(b"``)."""
    req = sf.request([1, 2])
    req.sampling.constraint.CopyFrom(common_pb2.Constraint(**kind))
    return req


BAD = {
    "no prompt": (_no_prompt, "prompt is empty"),
    "empty text": (lambda: sf.request(""), "prompt is empty"),
    "empty token list": (lambda: sf.request([]), "prompt is empty"),
    "token outside vocabulary": (lambda: sf.request([1, 2, 384]), "outside the model's vocabulary"),
    "negative temperature": (lambda: sf.request([1, 2], temperature=-0.5), "temperature must be >= 0"),
    "top_p zero": (lambda: sf.request([1, 2], temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
    "top_p above one": (lambda: sf.request([1, 2], temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
    "max_new_tokens above limit": (lambda: sf.request([1, 2], max_new_tokens=33), "at most 32"),
    "prompt too long": (lambda: sf.request(list(range(1, 18))), "limit of 16"),
    "unknown proposer": (lambda: sf.request([1, 2], proposer=7), "unknown proposer 7"),
    "unknown sampling mode": (lambda: sf.request([1, 2], sampling_mode=9), "unknown sampling_mode 9"),
    "gamma above max": (lambda: sf.request([1, 2], gamma=17), "maximum of 16"),
    "draft_top_k above vocabulary": (lambda: sf.request([1, 2], draft_top_k=999), "draft_top_k=999"),
    "min_confidence of one": (lambda: sf.request([1, 2], min_confidence=1.0), "must be in [0, 1)"),
    "negative min_confidence": (lambda: sf.request([1, 2], min_confidence=-0.1), "must be in [0, 1)"),
    "NaN min_confidence": (lambda: sf.request([1, 2], min_confidence=float("nan")), "must be in [0, 1)"),
    # A constraint is compiled before the session opens (specserve/coordinator/constraint_compiler.py).
    "regex that does not compile": (lambda: _constrained(regex="a(b"), "the regex constraint does not compile"),
    "schema of an unknown type": (lambda: _constrained(json_schema='{"type": "strin"}'), "strin"),
    "schema that is not JSON": (lambda: _constrained(json_schema="{"), "json_schema is not valid JSON"),
    "schema keyword not enforced": (lambda: _constrained(json_schema='{"uniqueItems": true}'), "uniqueItems"),
    "grammar with an undefined rule": (lambda: _constrained(grammar='root ::= "a" | b'), "'b' not found"),
    "schema over the size limit": (
        lambda: _constrained(json_schema=json.dumps({"description": "x" * 70_000})),
        "at most 65536 are accepted",
    ),
    "empty choice list": (lambda: _constrained(choice=common_pb2.ChoiceList()), "at least one string"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
async def test_bad_request_is_invalid_argument_saying_what_to_fix(stack, case):
    make, message = BAD[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sf.generate(stack.address, make())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


async def test_server_keeps_serving_while_bad_requests_fail(stack, pair):
    prompt = pair.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    good = [sf.generate(stack.address, sf.request(prompt, max_new_tokens=12, gamma=2)) for _ in range(3)]
    bad = [sf.generate(stack.address, make()) for make, _ in BAD.values()]
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    goods, bads = results[:3], results[3:]
    want = sf.reference_greedy(pair.target_dir, prompt, 12)
    for out in goods:
        assert not isinstance(out, BaseException), out
        assert out.token_ids == want
    for exc in bads:
        assert isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stack.coordinator.coordinator.active_sessions == 0


async def test_default_max_new_tokens_and_text_prompt(stack, pair):
    """max_new_tokens = 0 means the server's default; a text prompt is tokenized by the server."""
    text = "for i in range(10):"
    out = await sf.generate(stack.address, sf.request(text, max_new_tokens=0, ignore_eos=True))
    prompt = pair.tokenizer.encode(text, add_special_tokens=False)
    assert out.stats.prompt_tokens == len(prompt)
    assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 8, ignore_eos=True)
    assert out.stats.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert out.text == pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)


async def test_stop_string_ends_the_generation_and_cuts_the_text(stack, pair):
    prompt = "def add(a, b):"
    full = await sf.generate(stack.address, sf.request(prompt, max_new_tokens=24, ignore_eos=True))
    text = full.text
    assert len(text) > 6
    stop = text[3:6]  # a string the greedy completion contains
    out = await sf.generate(
        stack.address, sf.request(prompt, max_new_tokens=24, ignore_eos=True, stop_strings=[stop])
    )
    assert out.stats.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert out.text == text[: text.index(stop) + len(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)


async def test_a_constraint_that_cannot_finish_within_max_new_tokens_ends_with_length(stack, pair):
    """As OpenAI: the output is the constrained prefix it had reached, the finish ``length``."""
    req = _constrained(regex="[a-z]{40}")
    req.stop.max_new_tokens = 3
    out = await sf.generate(stack.address, req)
    assert out.stats.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(out.token_ids) == 3
    assert out.text and all("a" <= c <= "z" for c in out.text)
