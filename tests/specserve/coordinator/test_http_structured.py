"""Structured output over HTTP with the openai client: response_format, vLLM's guided fields, and forced tool calls
returned as ``tool_calls`` (whole and streamed), through a real stack of tiny models; a constraint that does not
compile, and ``tool_choice: "auto"``, are 400s naming the problem."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio
import system_fixtures as sf

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    overrides = {"http_port": 0, "served_model_name": MODEL, "max_new_tokens_limit": 512}
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=overrides) as s:
        yield s


@pytest.fixture
def oai(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.coordinator.http.url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_a_json_schema_response_format_gives_json_valid_under_it(oai, temperature):
    reply = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=temperature, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), WEATHER)


async def test_the_guided_fields_constrain_the_completions_endpoint(oai):
    regex = await oai.completions.create(
        model=MODEL, prompt="def", max_tokens=40, temperature=0.7, seed=1, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}
    )
    assert regex.choices[0].finish_reason == "stop" and len(regex.choices[0].text) == 6
    assert regex.choices[0].text[3] == "-" and regex.choices[0].text[:3].isdigit()
    choice = await oai.completions.create(
        model=MODEL, prompt="def", max_tokens=40, temperature=0.7, seed=2, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].text in ("yes", "no")


async def test_a_named_function_is_called_with_arguments_valid_under_its_parameters(oai):
    reply = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0.7, seed=5, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_required_call_streams_as_tool_call_deltas(oai, seed):
    stream = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0.7, seed=seed, tools=TOOLS,
        tool_choice="required", stream=True,
    )  # fmt: skip
    names, ids, arguments, finish = [], [], [], None
    async for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                assert delta.index == 0
                if delta.id:
                    ids.append(delta.id)
                if delta.function.name:
                    names.append(delta.function.name)
                arguments.append(delta.function.arguments or "")
            assert not choice.delta.content
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1 and len(names) == 1
    schema = {"get_weather": WEATHER, "get_time": TIME}[names[0]]
    jsonschema.validate(json.loads("".join(arguments)), schema)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         None, "strin"),
        ({"extra_body": {"guided_regex": "a(b"}}, None, "does not compile"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "parser"),
        ({"tools": TOOLS}, "tool_choice", "'auto'"),
    ],
    ids=["schema", "regex", "tool_choice auto", "tools without tool_choice"],
)  # fmt: skip
async def test_a_constraint_it_cannot_serve_is_a_400_naming_the_problem(oai, stack, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **body)
    error = info.value.body
    assert words in error["message"] and (param is None or error["param"] == param), error
    assert stack.coordinator.coordinator.active_sessions == 0
