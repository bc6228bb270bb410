"""specserve.coordinator.json_body.read_json: hostile bodies are refused with an InvalidArgument (HTTP 400) that names
the problem; ordinary bodies read as the standard library reads them. The same bodies against a running
server: tests/reliability/test_fuzz_schema.py::test_a_hostile_body_is_a_400_naming_the_problem."""

from __future__ import annotations

import json

import pytest

from specserve.api import errors
from specserve.coordinator.json_body import MAX_DEPTH, MAX_INTEGER_DIGITS, read_json

pytestmark = pytest.mark.unit


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


#: name -> (body, OpenAI code, words the message holds, param)
HOSTILE: dict[str, tuple[bytes, str, str, str | None]] = {
    "recursion (5,000 levels)": (_nested(5000).encode(), "too_deep", f"more than {MAX_DEPTH} levels", None),
    "objects 5,000 deep": (('{"a":' * 5000 + "1" + "}" * 5000).encode(), "too_deep", "levels", None),
    "deep nesting in a field": (
        json.dumps({"prompt": "x", "logit_bias": json.loads("{" + '"a":{' * 80 + "}" * 81)}).encode(),
        "too_deep",
        "the field 'logit_bias' nests",
        "logit_bias",
    ),
    "a huge exponent": (b'{"prompt": "x", "temperature": 1e999999}', "number_too_large", "out of range", None),
    "a negative huge exponent": (b'{"prompt": "x", "top_p": -1e400}', "number_too_large", "out of range", None),
    "a 100k-digit integer": (
        b'{"prompt": "x", "max_tokens": ' + b"9" * 100_000 + b"}",
        "number_too_large",
        "100000 digits",
        None,
    ),
    "NaN": (b'{"prompt": "x", "temperature": NaN}', "invalid_number", "NaN", None),
    "Infinity": (b'{"prompt": "x", "temperature": -Infinity}', "invalid_number", "-Infinity", None),
    "invalid UTF-8": (b'{"prompt": "caf\xe9"}', "invalid_encoding", "not valid UTF-8 (at byte 15)", None),
    "a lone surrogate escape": (
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "invalid_encoding",
        "the field 'messages' has a lone UTF-16 surrogate",
        "messages",
    ),
    "a duplicate key": (b'{"prompt": "x", "n": 1, "n": 64}', "duplicate_key", "the key 'n' appears twice", None),
    "a duplicate key deep inside": (
        b'{"prompt": "x", "response_format": {"type": "json_schema", "type": "text"}}',
        "duplicate_key",
        "'type' appears twice",
        None,
    ),
    "not JSON": (b'{"prompt": ', "invalid_json", "not valid JSON", None),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_a_hostile_body_is_invalid_argument_naming_the_problem(case):
    body, code, words, param = HOSTILE[case]
    with pytest.raises(errors.InvalidArgument) as info:
        read_json(body)
    assert info.value.openai_code == code
    assert words in info.value.message
    assert info.value.param == param


def test_ordinary_bodies_read_as_the_standard_library_reads_them():
    body = {
        "prompt": [1, 2, 3] * 1000,
        "temperature": 0.7,
        "seed": 2**64 - 1,
        "stop": ["\n", "caf\u00e9", "\U0001f600"],
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": 1e308}}},
        "nested": json.loads(_nested(MAX_DEPTH - 1)),  # the body's object is the first level: 64 in all
    }
    for encoded in (json.dumps(body).encode(), json.dumps(body, ensure_ascii=False).encode()):
        assert read_json(encoded) == body  # ensure_ascii writes the emoji as a surrogate pair: one character
    assert read_json(b"\xef\xbb\xbf" + json.dumps(body).encode()) == body, "a byte-order mark is skipped"
    assert read_json(_nested(MAX_DEPTH).encode()) == json.loads(_nested(MAX_DEPTH))
    assert read_json(b"-" + b"9" * MAX_INTEGER_DIGITS) == -int("9" * MAX_INTEGER_DIGITS)
    with pytest.raises(errors.InvalidArgument, match="levels"):
        read_json(_nested(MAX_DEPTH + 1).encode())
    with pytest.raises(errors.InvalidArgument, match="levels"):
        read_json(json.dumps({**body, "nested": [body["nested"]]}).encode())
