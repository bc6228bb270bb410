"""JSON from a client (an HTTP request's body; a gRPC request's ``template_kwargs_json``) read strictly:
hostile JSON is refused with a 400 (INVALID_ARGUMENT) that names the problem.

The standard library's parser, made strict (RFC 8259): the body must be UTF-8 (a byte-order mark is
skipped), an object must not repeat a key (which of two values counts would be the parser's choice),
numbers must be finite and integers at most :data:`MAX_INTEGER_DIGITS` digits long (``1e999999``
would be infinity, and reading a 100,000-digit integer is quadratic work), ``NaN`` and ``Infinity``
are not JSON, strings must not hold lone UTF-16 surrogates (``"\\ud800"`` is no character: it
cannot be encoded, or tokenized), and nothing may nest deeper than :data:`MAX_DEPTH` arrays and
objects (the parser recurses per level). Each refusal is an ``InvalidArgument`` (HTTP 400) with an
OpenAI ``code``, ``param`` naming the top-level field where one is known. docs/operations.md, "HTTP".
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from specserve.api.errors import InvalidArgument

#: Deepest nesting of arrays and objects in a body (the body itself is level 1).
MAX_DEPTH = 64
#: Longest integer, in digits: more than any field takes (a count, a seed, a schema's bound).
MAX_INTEGER_DIGITS = 100

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})


class _Refused(ValueError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(
                    f"the key {_quoted(key)} appears twice in one object of the request body; send each key once",
                    "duplicate_key",
                )
            seen.add(key)
    return obj


def _integer(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INTEGER_DIGITS:
        raise _Refused(
            f"an integer in the request body has {digits} digits, more than the {MAX_INTEGER_DIGITS} "
            "any field takes",
            "number_too_large",
        )
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(
            f"the number {_quoted(text)} in the request body is out of range (beyond a 64-bit float); "
            "numbers must be finite",
            "number_too_large",
        )
    return value


def _constant(name: str) -> float:
    raise _Refused(f"the request body has {name}, which is not JSON; numbers must be finite", "invalid_number")


def _quoted(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def bad_param(param: str | None, message: str, code: str) -> InvalidArgument:
    """An InvalidArgument with OpenAI's ``param`` and ``code`` (``openai_protocol.bad_param``'s shape)."""
    exc = InvalidArgument(message)
    exc.param = param  # type: ignore[attr-defined]
    exc.openai_code = code  # type: ignore[attr-defined]
    return exc


def read_json(data: bytes | str, what: str = "the request body") -> Any:
    """``data`` parsed, strictly (see the module docstring); InvalidArgument (400) names what is wrong,
    calling the document ``what``."""
    try:
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise bad_param(
            None, f"{what} is not valid UTF-8 (at byte {exc.start}); send JSON encoded in UTF-8",
            "invalid_encoding",
        ) from None
    try:
        value = json.loads(
            text, object_pairs_hook=_object, parse_int=_integer, parse_float=_float, parse_constant=_constant
        )
    except _Refused as exc:
        raise bad_param(None, exc.message.replace("the request body", what), exc.code) from None
    except RecursionError:
        raise _too_deep(None, what) from None
    except json.JSONDecodeError as exc:
        raise bad_param(
            None, f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", "invalid_json"
        ) from None
    _check_tree(value, what)
    return value


def _too_deep(field: str | None, what: str) -> InvalidArgument:
    where = f"the field '{field}'" if field is not None else what
    return bad_param(
        field, f"{where} nests arrays and objects more than {MAX_DEPTH} levels deep; flatten it", "too_deep"
    )


def _check_tree(value: Any, what: str) -> None:
    """Refuse nesting past :data:`MAX_DEPTH` and lone surrogates, naming the top-level field (no recursion)."""
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if isinstance(node, str):
            if _LONE_SURROGATE.search(node):
                where = f"the field '{field}'" if field is not None else what
                raise bad_param(
                    field, f"{where} has a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is no "
                    "character; send text as UTF-8 or as a surrogate pair", "invalid_encoding",
                )
            continue
        if isinstance(node, dict):
            children: list[tuple[str | None, Any]] = list(node.items())
            stack.extend((key, depth, field) for key in node)  # keys are strings too
        elif isinstance(node, list):
            if _SCALARS.issuperset(map(type, node)):
                children = []
            else:
                children = [(None, child) for child in node]
        else:
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(field, what)
        for key, child in children:
            stack.append((child, depth + 1, field if field is not None or depth > 1 else key))
