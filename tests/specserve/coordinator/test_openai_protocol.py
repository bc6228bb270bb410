"""OpenAI request bodies -> GenerateRequest messages, and what is refused (no servers)."""

from __future__ import annotations

import pytest

from specserve.api.errors import InvalidArgument
from specserve.coordinator.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_body(ChatCompletionRequest, {"messages": MESSAGES, **kw})


def completion(**kw):
    return parse_body(CompletionRequest, {"prompt": "def f(x):", **kw})


def test_every_chat_field_reaches_the_generate_request():
    body = chat(
        model="m",
        temperature=0.7,
        top_p=0.9,
        max_completion_tokens=12,
        max_tokens=99,
        stop=["\n\n", "END"],
        seed=7,
        n=3,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.2,
        ignore_eos=True,
        stop_token_ids=[3, 4],
        speculation={"gamma": 4, "proposer": "ngram", "draft_top_k": 8, "min_confidence": 0.25},
        user="someone",
        frequency_penalty=0,
        presence_penalty=0.0,
        logprobs=False,
        parallel_tool_calls=False,
        response_format={"type": "text"},
    )
    body.check_supported()
    pb = body.to_pb(2)
    assert pb.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in pb.chat.messages] == [("system", "be brief"), ("user", "hi")]
    s = pb.sampling
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert (s.top_k, s.seed) == (5, 9), "choice 2 of seed 7 uses seed 9"
    assert s.min_p == pytest.approx(0.05) and s.repetition_penalty == pytest.approx(1.2)
    assert pb.stop.max_new_tokens == 12, "max_completion_tokens wins over max_tokens"
    assert list(pb.stop.stop_strings) == ["\n\n", "END"] and list(pb.stop.stop_token_ids) == [3, 4]
    assert pb.stop.ignore_eos
    assert pb.speculation.gamma == 4 and pb.speculation.draft_top_k == 8
    assert pb.speculation.proposer == common_pb2.PROPOSER_KIND_NGRAM
    assert pb.speculation.min_confidence == pytest.approx(0.25)
    assert body.stop_strings == ("\n\n", "END") and not body.reply_options().include_usage


def test_defaults_follow_openai_and_leave_server_choices_absent():
    pb = chat().to_pb()
    assert pb.sampling.temperature == 1.0, "OpenAI's default temperature is 1"
    assert not pb.sampling.HasField("top_p") and not pb.sampling.HasField("seed")
    assert not pb.sampling.HasField("repetition_penalty")
    assert pb.stop.max_new_tokens == 0, "chat: the server's default length"
    assert not pb.speculation.HasField("gamma") and pb.speculation.proposer == common_pb2.PROPOSER_KIND_UNSPECIFIED  # the server's default
    assert not pb.speculation.HasField("min_confidence")
    assert completion().to_pb().stop.max_new_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert completion(max_tokens=5).to_pb().stop.max_new_tokens == 5
    assert chat(max_tokens=5).to_pb().stop.max_new_tokens == 5
    assert chat(top_k=-1).to_pb().sampling.top_k == 0, "vLLM's -1 disables top-k"
    assert not chat(speculation={"gamma": "auto"}).to_pb().speculation.HasField("gamma")
    assert chat(stop="x").to_pb().stop.stop_strings == ["x"]
    assert chat(seed=2**64 - 1).to_pb(1).sampling.seed == 0, "seeds wrap around 2**64"


def test_completion_prompts_text_tokens_and_one_item_lists():
    assert completion().to_pb().text == "def f(x):"
    assert list(parse_body(CompletionRequest, {"prompt": [5, 6, 7]}).to_pb().tokens.token_ids) == [5, 6, 7]
    assert parse_body(CompletionRequest, {"prompt": ["only one"]}).to_pb().text == "only one"
    assert list(parse_body(CompletionRequest, {"prompt": [[1, 2]]}).to_pb().tokens.token_ids) == [1, 2]


def test_text_content_parts_are_joined():
    body = parse_body(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    )
    body.check_supported()
    assert body.to_pb().chat.messages[0].content == "ab"


def test_logprobs_reach_the_generate_request_in_both_shapes():
    assert not chat().to_pb().HasField("logprobs")
    assert not chat(logprobs=False, top_logprobs=0).to_pb().HasField("logprobs")
    pb = chat(logprobs=True).to_pb()
    assert pb.HasField("logprobs") and pb.logprobs.top_logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).to_pb().logprobs.top_logprobs == 20
    assert not completion().to_pb().HasField("logprobs")
    pb = completion(logprobs=0).to_pb()
    assert pb.HasField("logprobs") and pb.logprobs.top_logprobs == 0
    assert completion(logprobs=5).to_pb().logprobs.top_logprobs == 5


def test_a_prediction_reaches_the_generate_request_as_text():
    assert not chat().to_pb().HasField("prediction")
    body = chat(prediction={"type": "content", "content": "def f(x):\n    return x\n"})
    body.check_supported()
    assert body.to_pb().prediction.text == "def f(x):\n    return x\n"
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    assert chat(prediction={"type": "content", "content": parts}).to_pb().prediction.text == "abcd"
    assert completion(prediction={"type": "content", "content": "x = 1"}).to_pb().prediction.text == "x = 1"


REFUSED = {
    "top_logprobs without logprobs": (chat, {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    "prediction image part": (
        chat,
        {"prediction": {"type": "content", "content": [{"type": "image_url"}]}},
        "prediction.content",
        "only text content parts",
    ),
    "frequency_penalty": (chat, {"frequency_penalty": 0.5}, "frequency_penalty", "repetition_penalty"),
    "presence_penalty": (completion, {"presence_penalty": -1}, "presence_penalty", "repetition_penalty"),
    "logit_bias": (chat, {"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    "tool_choice auto": (
        chat,
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        "tool_choice",
        "parser",
    ),
    "a tool that is not a function": (chat, {"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", "must be"),
    "response_format xml": (chat, {"response_format": {"type": "xml"}}, "response_format.type", "not supported"),
    "functions": (chat, {"functions": [{"name": "f"}]}, "functions", "send tools"),
    "echo": (completion, {"echo": True}, "echo", "not supported"),
    "suffix": (completion, {"suffix": "x"}, "suffix", "not supported"),
    "best_of": (completion, {"best_of": 3}, "best_of", "not supported"),
    "several prompts": (
        lambda **kw: parse_body(CompletionRequest, {"prompt": ["a", "b"], **kw}),
        {},
        "prompt",
        "one prompt per request",
    ),
    "image part": (
        lambda **kw: parse_body(
            ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        ),
        {},
        "messages[0].content",
        "only text content parts",
    ),
    "stream_options without stream": (chat, {"stream_options": {"include_usage": True}}, "stream_options", "only"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_unsupported_parameters_are_refused_naming_the_field(case):
    make, kwargs, param, needle = REFUSED[case]
    body = make(**kwargs)
    with pytest.raises(InvalidArgument) as info:
        body.check_supported()
    assert info.value.param == param
    assert needle in info.value.message


INVALID = {
    "unknown field": ({"messages": MESSAGES, "frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    "no messages": ({}, "messages", "missing required parameter: messages"),
    "n zero": ({"messages": MESSAGES, "n": 0}, "n", "invalid value for n"),
    "negative seed": ({"messages": MESSAGES, "seed": -1}, "seed", "invalid value for seed"),
    "temperature text": ({"messages": MESSAGES, "temperature": "hot"}, "temperature", "invalid value"),
    "bad gamma": ({"messages": MESSAGES, "speculation": {"gamma": -2}}, "speculation.gamma", "invalid value"),
    "bad proposer": ({"messages": MESSAGES, "speculation": {"proposer": "oracle"}}, "speculation.proposer", ""),
    "min_confidence of one": (
        {"messages": MESSAGES, "speculation": {"min_confidence": 1.0}},
        "speculation.min_confidence",
        "",
    ),
    "top_logprobs above 20": ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ""),
    "prediction type": (
        {"messages": MESSAGES, "prediction": {"type": "file", "content": "x"}},
        "prediction.type",
        "invalid value",
    ),
    # JSON types as the schema gives them, no coercion (schemathesis found 0.0 accepted as a bool).
    "number for a bool": ({"messages": MESSAGES, "parallel_tool_calls": 0.0}, "parallel_tool_calls", ""),
    "string for a bool": ({"messages": MESSAGES, "stream": "true"}, "stream", ""),
    "number for a string": ({"messages": MESSAGES, "user": 7}, "user", ""),
    "fraction for an int": ({"messages": MESSAGES, "max_tokens": 2.5}, "max_tokens", ""),
    "tool_calls": (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        "messages.0.tool_calls",
        "unsupported field",
    ),
}


def test_completion_logprobs_out_of_range_are_invalid():
    for value in (-1, 21):
        with pytest.raises(InvalidArgument) as info:
            completion(logprobs=value)
        assert info.value.param == "logprobs"


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_malformed_bodies_are_invalid_naming_the_field(case):
    body, param, needle = INVALID[case]
    with pytest.raises(InvalidArgument) as info:
        parse_body(ChatCompletionRequest, body)
    assert info.value.param == param
    assert needle in info.value.message
    with pytest.raises(InvalidArgument, match="JSON object"):
        parse_body(ChatCompletionRequest, [body])
