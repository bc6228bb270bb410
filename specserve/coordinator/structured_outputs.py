"""Structured output over HTTP: the OpenAI and vLLM fields as one constraint, and forced tool calls shaped
as ``tool_calls``.

Pure data: no HTTP, no sessions. :func:`structured_output` reads a request's ``response_format``, vLLM's
``guided_*`` and ``structured_outputs`` fields, or ``tools`` with a ``tool_choice`` that forces a call, and
returns the one :class:`~specserve.api.constraints.Constraint` its sessions generate under, plus the
:class:`ToolCallShape` when the reply is a tool call; at most one of them may constrain a request, and each
problem is a 400 naming the field (``tool_choice: "auto"`` needs the model's own tool-call parser and is
refused). Every field and what it does: docs/operations.md, "Structured outputs".
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument

#: The constraint engine's name, the one ``guided_decoding_backend`` may name (besides ``auto``).
ENGINE = "llguidance"
#: OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: How the engine writes JSON (no free whitespace): a wrapped call's text starts with its prefix.
_ITEM, _KEY = ", ", ": "
#: The fields that may carry a constraint, in the order they are read.
CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidArgument:
    exc = InvalidArgument(message)
    exc.param = param  # type: ignore[attr-defined]
    exc.openai_code = code  # type: ignore[attr-defined]
    return exc


@dataclass(frozen=True)
class ToolCallShape:
    """How a forced tool call's output becomes ``tool_calls``: ``names`` the functions it may call; with
    one, the output is its arguments, with several it is ``{"name": ..., "arguments": ...}``."""

    names: tuple[str, ...]

    @property
    def wrapped(self) -> bool:
        return len(self.names) > 1

    def prefix(self, name: str) -> str:
        """The start of a wrapped output that calls ``name``, up to its arguments."""
        return "{" + json.dumps("name") + _KEY + json.dumps(name) + _ITEM + json.dumps("arguments") + _KEY


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's fields ask: the ``constraint`` (None: free text) and the ``tool`` shape of the
    reply (None: text)."""

    constraint: Constraint | None = None
    tool: ToolCallShape | None = None


def structured_output(fields: Mapping[str, Any], *, tools_allowed: bool) -> StructuredOutput:
    """The constraint and reply shape of a request's ``fields`` (its attributes by name; absent or None:
    not sent). ``tools_allowed``: the endpoint knows ``tools`` (chat). InvalidArgument names the field."""
    backend = fields.get("guided_decoding_backend")
    if backend not in (None, "auto", ENGINE):
        raise _bad(
            "guided_decoding_backend",
            f"guided_decoding_backend={backend!r} is not this server's engine: send {ENGINE!r} or 'auto', "
            "or leave it out",
            "unsupported_value",
        )
    if fields.get("guided_whitespace_pattern") is not None:
        raise _bad(
            "guided_whitespace_pattern",
            "guided_whitespace_pattern is not supported: JSON is generated without free whitespace "
            "(', ' and ': ' separators); leave it out",
            "unsupported_parameter",
        )
    found = [
        (name, c) for name in CONSTRAINT_FIELDS if (c := _constraint_of(name, fields.get(name))) is not None
    ]
    tool = _tool(fields, tools_allowed) if tools_allowed else None
    if tool is not None:
        if found:
            raise _bad(
                found[0][0],
                f"{found[0][0]} cannot be combined with a forced tool call: the call's arguments are the "
                "output, constrained by the function's parameters",
                "unsupported_value",
            )
        return StructuredOutput(tool[0], tool[1])
    if len(found) > 1:
        raise _bad(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: send one")
    return StructuredOutput(found[0][1] if found else None)


def _checked(param: str, make) -> Constraint:
    """``make()``, its InvalidArgument naming ``param``."""
    try:
        return make()
    except InvalidArgument as exc:
        raise _bad(param, f"{param}: {exc.message}") from None


def _schema_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict):
        raise _bad(param, f"{param} must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema)


def _constraint_of(name: str, value: Any) -> Constraint | None:
    if value is None:
        return None
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        return _checked(name, lambda: Constraint("json_schema", _schema_text(name, value)))
    if name == "guided_regex":
        if not isinstance(value, str):
            raise _bad(name, f"{name} must be a string")
        return _checked(name, lambda: Constraint("regex", value))
    if name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise _bad(name, f"{name} must be a list of strings")
        return _checked(name, lambda: Constraint("choice", tuple(value)))
    if name == "guided_grammar":
        if not isinstance(value, str):
            raise _bad(name, f"{name} must be a string (EBNF with a root rule)")
        return _checked(name, lambda: Constraint("grammar", value))
    return _structured_outputs(value)


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise _bad(
            f"{param}.type",
            f"response_format type {kind!r} is not supported: send 'text', 'json_object' or 'json_schema'",
            "unsupported_value",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(f"{param}.json_schema", "response_format json_schema needs a json_schema object")
    if "schema" not in spec:
        raise _bad(f"{param}.json_schema.schema", "response_format json_schema needs its schema")
    return _checked(
        f"{param}.json_schema.schema",
        lambda: Constraint("json_schema", _schema_text(f"{param}.json_schema.schema", spec["schema"])),
    )


def _structured_outputs(value: Any) -> Constraint:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _bad(param, f"{param} must be an object with one of json, regex, choice, grammar, json_object")
    unknown = sorted(set(value) - {*_STRUCTURED_KEYS, "json_object"})
    if unknown:
        raise _bad(
            f"{param}.{unknown[0]}",
            f"{param}.{unknown[0]} is not supported: send one of json, regex, choice, grammar, json_object",
            "unsupported_parameter",
        )
    given = [k for k in value if value[k] is not None and value[k] is not False]
    if len(given) != 1:
        raise _bad(param, f"{param} must set exactly one of json, regex, choice, grammar, json_object")
    key = given[0]
    if key == "json_object":
        return Constraint("json_object")
    guided = {
        "json": "guided_json",
        "regex": "guided_regex",
        "choice": "guided_choice",
        "grammar": "guided_grammar",
    }
    try:
        constraint = _constraint_of(guided[key], value[key])
    except InvalidArgument as exc:
        raise _bad(f"{param}.{key}", exc.message.replace(guided[key], f"{param}.{key}")) from None
    assert constraint is not None
    return constraint


def _functions(tools: Any) -> dict[str, dict]:
    """The tools' parameter schemas by function name (checked)."""
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise _bad(
                param,
                f"{param} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
            )
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise _bad(f"{param}.function.name", "a function's name must be 1-64 of a-z, A-Z, 0-9, _ and -")
        if name in functions:
            raise _bad(f"{param}.function.name", f"two tools are named {name!r}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, dict):
            raise _bad(
                f"{param}.function.parameters", "a function's parameters must be a JSON schema (an object)"
            )
        functions[name] = parameters
    return functions


def _tool(fields: Mapping[str, Any], tools_allowed: bool) -> tuple[Constraint, ToolCallShape] | None:
    tools, choice = fields.get("tools"), fields.get("tool_choice")
    if choice == "none" or (tools is None and choice is None):
        return None
    if tools is None:
        raise _bad("tool_choice", "tool_choice needs tools")
    functions = _functions(tools)
    if choice is None or choice == "auto":
        raise _bad(
            "tool_choice",
            "tool_choice 'auto' (the default when tools are sent) is not supported: it needs a parser for the "
            "model's own tool-call format; name a function ({'type': 'function', 'function': {'name': ...}}) "
            "or send 'required', and the arguments are generated under the function's parameters schema",
            "unsupported_value",
        )
    if choice == "required":
        names = tuple(functions)
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if name not in functions:
            raise _bad(
                "tool_choice.function.name", f"tool_choice names {name!r}, which is not among the tools"
            )
        names = (name,)
    else:
        raise _bad(
            "tool_choice",
            "tool_choice must be 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )
    shape = ToolCallShape(names)
    if not shape.wrapped:
        schema: dict = functions[names[0]]
    else:
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": functions[name]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name in names
            ]
        }
    return _checked("tools", lambda: Constraint("json_schema", json.dumps(schema))), shape


def call_id() -> str:
    """A new tool call's id, as OpenAI's look."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallText:
    """One choice's text as one tool call, whole (:meth:`message`) or streamed (:meth:`push`, :meth:`finish`).

    A wrapped output (several tools) is held back until its name is known. The closing brace of the
    wrapper is then held back too, so the arguments stream on their own. An output that ends before
    its name is known (``length``) comes back as plain content.
    """

    def __init__(self, shape: ToolCallShape) -> None:
        self.shape = shape
        self.id = call_id()
        self._name: str | None = None if shape.wrapped else shape.names[0]
        self._pending = ""  # text not yet sent: all of it until the name is known, then the wrapper's "}"
        self._sent_header = False

    def _match(self, text: str) -> tuple[str, str] | None:
        """``(name, arguments text)`` of a wrapped output whose prefix is complete."""
        for name in self.shape.names:
            prefix = self.shape.prefix(name)
            if text.startswith(prefix):
                return name, text[len(prefix) :]
        return None

    def _header(self, arguments: str) -> dict[str, Any]:
        self._sent_header = True
        return {
            "index": 0,
            "id": self.id,
            "type": "function",
            "function": {"name": self._name, "arguments": arguments},
        }

    def push(self, text: str) -> list[dict[str, Any]]:
        """A delta of text; the ``delta.tool_calls`` entries to send now (maybe none)."""
        if self._name is None:
            self._pending += text
            found = self._match(self._pending)
            if found is None:
                return []
            self._name, rest = found
            self._pending = ""
            text = rest
        if self.shape.wrapped:
            text = self._pending + text
            text, self._pending = text[:-1], text[-1:]
        if not self._sent_header:
            return [self._header(text)]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def finish(self, stopped: bool) -> tuple[list[dict[str, Any]], str]:
        """At the end: the last ``tool_calls`` entries, and text to send as content instead (an output cut
        short before its function was known). ``stopped``: the output is complete (not ``length``)."""
        rest, self._pending = self._pending, ""
        if self._name is None:
            return [], rest
        if self.shape.wrapped and stopped and rest.endswith("}"):
            rest = rest[:-1]
        if not self._sent_header:
            return [self._header(rest)], ""
        return ([{"index": 0, "function": {"arguments": rest}}] if rest else []), ""

    def message(self, text: str, stopped: bool) -> dict[str, Any]:
        """The non-streamed ``message`` of the whole ``text``."""
        name, arguments = (
            (self.shape.names[0], text) if not self.shape.wrapped else (self._match(text) or (None, ""))
        )
        if name is None:
            return {"role": "assistant", "content": text}
        if self.shape.wrapped and stopped and arguments.endswith("}"):
            arguments = arguments[:-1]
        call = {"id": self.id, "type": "function", "function": {"name": name, "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
