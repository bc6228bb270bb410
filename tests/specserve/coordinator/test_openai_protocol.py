"""OpenAI request bodies -> the coordinator's requests (settings and prompt), and what is refused (no servers)."""

from __future__ import annotations

import struct

import pytest

from specserve.api.errors import InvalidArgument
from specserve.api.params import GenerationParams
from specserve.coordinator.chat import Conversation
from specserve.coordinator.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from specserve.coordinator.requests import Prompt

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
    params, prompt = body.generation(2)
    assert prompt.text is None and prompt.token_ids is None
    assert prompt.chat.messages == (("system", "be brief"), ("user", "hi"))
    assert params.temperature == pytest.approx(0.7) and params.top_p == pytest.approx(0.9)
    assert (params.top_k, params.seed) == (5, 9), "choice 2 of seed 7 uses seed 9"
    assert params.min_p == pytest.approx(0.05) and params.repetition_penalty == pytest.approx(1.2)
    assert params.max_new_tokens == 12, "max_completion_tokens wins over max_tokens"
    assert params.stop == ("\n\n", "END") and params.stop_token_ids == (3, 4)
    assert params.ignore_eos
    assert params.gamma == 4 and params.draft_top_k == 8
    assert params.proposer == "ngram"
    assert params.min_confidence == pytest.approx(0.25)
    assert body.stop_strings == ("\n\n", "END") and not body.reply_options().include_usage


def test_settings_are_the_wires_32_bit_floats_as_over_grpc():
    """An HTTP body's settings are what a GenerateRequest carries (GenerationParams.as_sent): the same
    request over HTTP and over gRPC samples alike."""
    params, _ = chat(temperature=0.7, top_p=0.9).generation()
    assert params.temperature == struct.unpack("f", struct.pack("f", 0.7))[0] != 0.7
    assert params == GenerationParams.from_pb(params.to_pb())


def test_defaults_follow_openai_and_leave_server_choices_absent():
    params, _ = chat().generation()
    assert params.temperature == 1.0, "OpenAI's default temperature is 1"
    assert params.top_p == 1.0 and params.seed is None
    assert params.repetition_penalty == 1.0
    assert params.max_new_tokens is None, "chat: the server's default length"
    assert params.gamma is None and params.proposer is None  # the server's default
    assert params.min_confidence is None
    assert completion().generation()[0].max_new_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert completion(max_tokens=5).generation()[0].max_new_tokens == 5
    assert chat(max_tokens=5).generation()[0].max_new_tokens == 5
    assert chat(top_k=-1).generation()[0].top_k == 0, "vLLM's -1 disables top-k"
    assert chat(speculation={"gamma": "auto"}).generation()[0].gamma is None
    assert chat(stop="x").generation()[0].stop == ("x",)
    assert chat(seed=2**64 - 1).generation(1)[0].seed == 0, "seeds wrap around 2**64"


def test_completion_prompts_text_tokens_and_one_item_lists():
    assert completion().generation()[1] == Prompt(text="def f(x):")
    assert parse_body(CompletionRequest, {"prompt": [5, 6, 7]}).generation()[1] == Prompt(token_ids=(5, 6, 7))
    assert parse_body(CompletionRequest, {"prompt": ["only one"]}).generation()[1] == Prompt(text="only one")
    assert parse_body(CompletionRequest, {"prompt": [[1, 2]]}).generation()[1] == Prompt(token_ids=(1, 2))


def test_text_content_parts_are_joined():
    body = parse_body(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    )
    body.check_supported()
    assert body.generation()[1].chat.messages == (("user", "ab"),)


def test_chat_template_options_reach_the_conversation():
    body = chat(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"b": 1, "a": True})
    conversation = body.generation()[1].chat
    assert conversation.omit_generation_prompt and conversation.continue_final_message
    assert conversation.template_kwargs_json == '{"a": true, "b": 1}'
    assert chat().generation()[1].chat == Conversation(messages=(("system", "be brief"), ("user", "hi")))


def test_logprobs_reach_the_generate_request_in_both_shapes():
    def logprobs(body):
        params = body.generation()[0]
        return params.top_logprobs if params.logprobs else None

    assert logprobs(chat()) is None
    assert logprobs(chat(logprobs=False, top_logprobs=0)) is None
    assert logprobs(chat(logprobs=True)) == 0
    assert logprobs(chat(logprobs=True, top_logprobs=20)) == 20
    assert logprobs(completion()) is None
    assert logprobs(completion(logprobs=0)) == 0
    assert logprobs(completion(logprobs=5)) == 5


def test_a_prediction_reaches_the_generate_request_as_text():
    assert chat().generation()[0].prediction is None
    body = chat(prediction={"type": "content", "content": "def f(x):\n    return x\n"})
    body.check_supported()
    assert body.generation()[0].prediction == "def f(x):\n    return x\n"
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    assert chat(prediction={"type": "content", "content": parts}).generation()[0].prediction == "abcd"
    body = completion(prediction={"type": "content", "content": "x = 1"})
    assert body.generation()[0].prediction == "x = 1"


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
