"""The gRPC servicer is the coordinator's front end's edge with the wire: a ``GenerateRequest`` in as settings and a
prompt, the same an OpenAI body gives over HTTP (no servers)."""

from __future__ import annotations

import pytest

from specserve.api.errors import InvalidArgument
from specserve.api.params import GenerationParams
from specserve.api.stats import GenerationStats
from specserve.coordinator.chat import Conversation
from specserve.coordinator.coordinator import Chunk, Finished
from specserve.coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body
from specserve.coordinator.requests import Prompt
from specserve.coordinator.servicer import request_from_pb, response_pb
from specserve.v1 import common_pb2, coordinator_pb2

pytestmark = pytest.mark.unit


def test_each_prompt_kind_comes_in_as_sent():
    assert request_from_pb(coordinator_pb2.GenerateRequest(text="hi"))[1] == Prompt(text="hi")
    assert request_from_pb(coordinator_pb2.GenerateRequest(text=""))[1] == Prompt(text=""), "sent, but empty"
    tokens = coordinator_pb2.GenerateRequest()
    tokens.tokens.SetInParent()
    assert request_from_pb(tokens)[1] == Prompt(token_ids=())
    tokens.tokens.token_ids.extend([4, 5])
    assert request_from_pb(tokens)[1] == Prompt(token_ids=(4, 5))
    assert request_from_pb(coordinator_pb2.GenerateRequest())[1] == Prompt()
    chat = coordinator_pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="hi")
    chat.chat.continue_final_message = True
    chat.chat.template_kwargs_json = '{"a": 1}'
    assert request_from_pb(chat)[1] == Prompt(
        chat=Conversation(messages=(("user", "hi"),), continue_final_message=True, template_kwargs_json='{"a": 1}')
    )


def test_the_settings_are_checked_at_the_edge():
    bad = coordinator_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(temperature=0.001))
    with pytest.raises(InvalidArgument, match="too small"):
        request_from_pb(bad)


def test_a_body_over_http_is_the_request_its_generate_request_is_over_grpc():
    body = parse_body(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 3,
            "chat_template_kwargs": {"x": 1},
            "speculation": {"min_confidence": 0.3},
        },
    )
    params, prompt = body.generation(1)
    pb = params.to_pb()
    pb.chat.messages.add(role="user", content="hi")
    pb.chat.template_kwargs_json = '{"x": 1}'
    assert request_from_pb(pb) == (params, prompt)
    completion = parse_body(CompletionRequest, {"prompt": [1, 2], "min_p": 0.1})
    params, prompt = completion.generation()
    pb = params.to_pb()
    pb.tokens.token_ids.extend([1, 2])
    assert request_from_pb(pb) == (params, prompt) and isinstance(params, GenerationParams)


def test_events_go_out_as_generate_responses():
    chunk = response_pb(Chunk((7, 8), "ab"))
    assert chunk.WhichOneof("event") == "chunk" and list(chunk.chunk.token_ids) == [7, 8] and chunk.chunk.text == "ab"
    counts = dict.fromkeys(["prompt_tokens", "rounds", "proposed_tokens", "accepted_tokens", "draft_ns"], 0)
    counts.update(dict.fromkeys(["verify_ns", "queue_ns", "first_token_ns", "total_ns"], 0))
    stats = GenerationStats(
        session_id="s",
        completion_tokens=2,
        seed=5,
        accepted_per_position=(),
        finish_reason="length",
        **counts,
    )
    done = response_pb(Finished(stats))
    assert done.WhichOneof("event") == "stats"
    assert (done.stats.session_id, done.stats.completion_tokens, done.stats.seed) == ("s", 2, 5)
