"""docs/operations.md's table of request fields against the HTTP API's parsing: every field a request
model defines has a row, and every row behaves as it says (honoured: it changes what is served;
ignored: it does not; refused: a 400 naming it). A field honoured only with another (``tools`` and
``tool_choice``) has both in its example; without it the request may be refused. What is served is :meth:`effect`: the model named,
whether it streams, each choice's ``GenerateRequest`` and the reply's options, everything the HTTP
layer reads from a request."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from specserve.api.errors import InvalidArgument
from specserve.coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body

pytestmark = pytest.mark.unit

OPERATIONS = Path(__file__).resolve().parents[3] / "docs" / "operations.md"
ENDPOINTS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "completions": {"prompt": "hi"},
}
#: Models whose fields the table lists one by one (``stream_options.include_usage``).
NESTED = {"stream_options"}


def table_rows() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(field, endpoint, status, example) for each row and endpoint of the table after "**Request fields.**"."""
    text = OPERATIONS.read_text()
    start = text.index("**Request fields.**")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        field, endpoints, status, example = (c.strip("`") for c in cells[:4])
        for endpoint in ENDPOINTS if endpoints == "both" else [endpoints]:
            rows.append((field, endpoint, status, json.loads(example)))
    return rows


ROWS = table_rows()


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def without(body: dict[str, Any], field: str) -> dict[str, Any]:
    out = copy.deepcopy(body)
    *parents, leaf = field.split(".")
    node = out
    for part in parents:
        node = node[part]
    del node[leaf]
    return out


def served(endpoint: str, body: dict[str, Any]) -> tuple[Any, ...]:
    request = parse_body(ENDPOINTS[endpoint], body)
    request.check_supported()
    return request.effect()


def served_or_refused(endpoint: str, body: dict[str, Any]) -> Any:
    """What is served, or the refusal's field and message (``tool_choice`` without ``tools`` is refused)."""
    try:
        return served(endpoint, body)
    except InvalidArgument as exc:
        return ("refused", getattr(exc, "param", None), exc.message)


def test_the_table_lists_every_field_of_both_request_models():
    assert ROWS, "docs/operations.md has no request field table"
    for endpoint, cls in ENDPOINTS.items():
        listed = {field for field, e, _, _ in ROWS if e == endpoint}
        defined = set()
        for name, info in cls.model_fields.items():
            if name in NESTED:
                nested = info.annotation.__args__[0]  # StreamOptions | None
                defined |= {f"{name}.{sub}" for sub in nested.model_fields}
            else:
                defined.add(name)
        assert listed == defined, f"{endpoint}: missing rows {defined - listed}, rows of no field {listed - defined}"
    assert {status for _, _, status, _ in ROWS} == {"honoured", "ignored", "refused"}


@pytest.mark.parametrize(("field", "endpoint", "status", "example"), ROWS, ids=[f"{r[1]}:{r[0]}" for r in ROWS])
def test_each_field_behaves_as_its_row_says(field, endpoint, status, example):
    body = merged(BASE[endpoint], example)
    if status == "refused":
        with pytest.raises(InvalidArgument) as refused:
            served(endpoint, body)
        assert refused.value.param == field.split(".")[0], refused.value.message  # type: ignore[attr-defined]
        return
    reference = BASE[endpoint] if field in BASE[endpoint] else without(body, field)
    if status == "honoured":  # served, and otherwise than without it (which may be refused)
        assert served(endpoint, body) != served_or_refused(endpoint, reference), f"{field} changed nothing"
    else:
        assert served(endpoint, body) == served(endpoint, reference), f"{field} changed what is served"


def test_unknown_fields_are_refused_by_default_and_dropped_when_ignored():
    body = {**BASE["chat"], "max_token": 5, "stream": True, "stream_options": {"include_usage": True, "x": 1}}
    with pytest.raises(InvalidArgument, match=r"unsupported field stream_options\.x"):
        parse_body(ChatCompletionRequest, body)
    ignored = parse_body(ChatCompletionRequest, body, unknown_fields="ignore")
    plain = parse_body(ChatCompletionRequest, without(without(body, "max_token"), "stream_options.x"))
    assert ignored.effect() == plain.effect()
    with pytest.raises(InvalidArgument, match="invalid value for temperature"):  # other errors still count
        parse_body(ChatCompletionRequest, {**body, "temperature": "hot"}, unknown_fields="ignore")


def test_vllm_defaults_are_accepted_where_the_extension_is_not_implemented():
    defaults = {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "use_beam_search": False,
        "length_penalty": 1.0, "truncate_prompt_tokens": None, "bad_words": [], "priority": 0,
        "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
        "echo": False, "chat_template_kwargs": {}, "return_tokens_as_token_ids": False,
    }
    assert served("chat", {**BASE["chat"], **defaults}) == served("chat", BASE["chat"])
