"""specserve/coordinator/structured_outputs.py: each HTTP field that constrains the output becomes its Constraint, every
mistake is a 400 naming the field, and a forced tool call's text becomes OpenAI ``tool_calls``, whole or streamed."""

from __future__ import annotations

import json

import pytest

from specserve.api.constraints import MAX_CONSTRAINT_BYTES, Constraint
from specserve.api.errors import InvalidArgument
from specserve.coordinator.structured_outputs import ToolCallShape, ToolCallText, structured_output

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object


def _out(**fields):
    return structured_output(fields, tools_allowed=True)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
            Constraint("json_schema", json.dumps(SCHEMA)),
        ),
        ({"guided_json": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA))),
        ({"guided_json": '{"type": "integer"}'}, Constraint("json_schema", '{"type": "integer"}')),
        ({"guided_regex": "[0-9]{3}"}, Constraint("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, Constraint("choice", ("yes", "no"))),
        ({"guided_grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+")),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json_object": True}}, Constraint("json_object")),
        ({"guided_regex": "a", "guided_decoding_backend": "llguidance"}, Constraint("regex", "a")),
        ({"tools": [WEATHER], "tool_choice": "none"}, None),
    ],
)
def test_each_field_becomes_its_constraint(fields, expected):
    out = _out(**fields)
    assert out.constraint == expected and out.tool is None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml' is not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "needs its schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format.json_schema.schema", "must be a JSON schema"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": 5}, "guided_regex", "must be a string"),
        ({"guided_regex": ""}, "guided_regex", "must not be empty"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
        ({"guided_grammar": " "}, "guided_grammar", "must not be empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "structured_outputs.choice"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "not this server's engine"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "without free whitespace"),
        ({"guided_regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}, "guided_regex", "at most"),
        ({"tools": [WEATHER]}, "tool_choice", "'auto'"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "not among"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools[0].function.name", "a-z"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", "two tools"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", "must be"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "forced tool call"),
    ],
)  # fmt: skip
def test_each_mistake_is_a_400_naming_the_field(fields, param, words):
    with pytest.raises(InvalidArgument) as info:
        _out(**fields)
    assert info.value.param == param  # type: ignore[attr-defined]
    assert words in info.value.message


def test_a_named_function_constrains_its_arguments_and_a_required_choice_of_several_wraps_them():
    named = _out(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint == Constraint("json_schema", json.dumps(SCHEMA))
    assert named.tool == ToolCallShape(("get_weather",))
    only = _out(tools=[TIME], tool_choice="required")
    assert json.loads(only.constraint.text) == {"type": "object", "properties": {}, "additionalProperties": False}
    several = _out(tools=[WEATHER, TIME], tool_choice="required")
    assert several.tool == ToolCallShape(("get_weather", "get_time")) and several.tool.wrapped
    branches = json.loads(several.constraint.text)["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert branches[0]["properties"]["arguments"] == SCHEMA
    # The completions endpoint has no tools: they are not read there.
    assert structured_output({"tools": [WEATHER]}, tools_allowed=False) == structured_output({}, tools_allowed=False)


def _stream(shape: ToolCallShape, pieces: list[str], stopped: bool = True) -> tuple[list[dict], str]:
    calls = ToolCallText(shape)
    deltas = [d for piece in pieces for d in calls.push(piece)]
    last, content = calls.finish(stopped)
    return deltas + last, content


def _joined(deltas: list[dict]) -> tuple[str | None, str]:
    names = {d["function"]["name"] for d in deltas if "name" in d["function"]}
    assert len(names) <= 1 and all(d["index"] == 0 for d in deltas)
    assert sum("id" in d for d in deltas) == (1 if deltas else 0) and ("id" in deltas[0] if deltas else True)
    return (names.pop() if names else None), "".join(d["function"]["arguments"] for d in deltas)


def test_a_named_call_streams_its_arguments_as_they_come_and_whole_as_one_message():
    shape = ToolCallShape(("get_weather",))
    text = '{"city": "Paris"}'
    deltas, content = _stream(shape, ['{"ci', 'ty": "Par', 'is"}'])
    assert _joined(deltas) == ("get_weather", text) and content == ""
    message = ToolCallText(shape).message(text, stopped=True)
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": text}


def test_a_wrapped_call_is_held_until_its_name_is_known_and_loses_the_wrapper():
    shape = ToolCallShape(("get_weather", "get_time"))
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for cut in (1, 9, 20, 37, 38, len(text) - 1):  # cut inside the name, at the arguments, at the end
        deltas, content = _stream(shape, [text[:cut], text[cut:]])
        assert _joined(deltas) == ("get_weather", '{"city": "Paris"}') and content == "", cut
    call = ToolCallText(shape).message(text, stopped=True)["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_an_output_cut_short_keeps_what_it_has():
    wrapped = ToolCallShape(("get_weather", "get_time"))
    # Cut before the name is complete: plain content.
    assert _stream(wrapped, ['{"name": "get_w'], stopped=False) == ([], '{"name": "get_w')
    assert ToolCallText(wrapped).message('{"name": "get_w', stopped=False) == {
        "role": "assistant",
        "content": '{"name": "get_w',
    }
    # Cut inside the arguments: the partial arguments, the last character not taken for the wrapper's.
    deltas, _ = _stream(wrapped, ['{"name": "get_time", "arguments": {"a": "x}'], stopped=False)
    assert _joined(deltas) == ("get_time", '{"a": "x}')
    named = ToolCallShape(("get_weather",))
    assert _joined(_stream(named, ['{"ci'], stopped=False)[0]) == ("get_weather", '{"ci')
