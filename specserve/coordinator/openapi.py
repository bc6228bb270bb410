"""The OpenAPI description of the HTTP API (``GET /openapi.json``), complete enough to fuzz it from.

The routes read their bodies themselves (:meth:`specserve.coordinator.http_api.OpenAIServer.admit`: the size is
checked before any parsing), so FastAPI alone would describe ``POST /v1/completions`` and
``POST /v1/chat/completions`` without a body. This module adds what a client or a fuzzer needs:

* each POST's request body, the JSON Schema of its pydantic model
  (:class:`~specserve.coordinator.openai_protocol.CompletionRequest`,
  :class:`~specserve.coordinator.openai_protocol.ChatCompletionRequest`: types, ranges, required fields, no extra
  fields), under ``components/schemas``, narrowed to what this server accepts: the fields it does not
  implement only absent, null or at their default, ``max_tokens`` up to its ``max_new_tokens_limit``;
* every status a route answers, errors with OpenAI's shape (``ErrorResponse``:
  ``{"error": {"message", "type", "param", "code"}}``); a generation's 200 is JSON, or
  ``text/event-stream`` with ``"stream": true``.

``tests/specserve/coordinator/test_http_schema_fuzz.py`` fuzzes the API from this description (schemathesis);
docs/reliability.md has its figures.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from specserve.coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest

#: POST route -> the pydantic model of its body.
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's error shape.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_STATUSES = {
    "400": "a bad parameter or body",
    "401": "a missing or unknown API key (with auth_tokens set)",
    "404": "an unknown model",
    "413": "a body larger than max_message_bytes",
    "429": "a session limit, with Retry-After (whole seconds) and retry-after-ms",
    "499": "the client went away",
    "503": "no target replica could serve, or the coordinator is draining",
    "504": "a deadline passed",
}


def _errors(*statuses: str) -> dict[str, Any]:
    return {
        s: {"description": _ERROR_STATUSES[s], "content": {"application/json": {"schema": _ERROR}}} for s in statuses
    }


def _narrow(body: dict[str, Any], model: type[CompletionRequest | ChatCompletionRequest], max_tokens: int) -> None:
    """What the model's types allow but this server refuses, in the body's schema: the unsupported fields
    (accepted only absent, null or at their default) and ``max_tokens`` past the server's limit."""
    props = body["properties"]
    for name, (default, why) in model.unsupported_fields().items():
        allowed = [None] if default is None else [None, default]
        props[name] = {"enum": allowed, "default": None, "description": f"not supported: {why}"}
    for name in ("max_tokens", "max_completion_tokens"):
        for branch in props.get(name, {}).get("anyOf", []):
            if branch.get("type") == "integer":
                branch.pop("exclusiveMaximum", None)
                branch["maximum"] = max_tokens


def openapi_schema(app: FastAPI, *, version: str, max_tokens: int) -> dict[str, Any]:
    """The app's OpenAPI document (built once, then cached on the app, as FastAPI does); ``max_tokens``:
    the server's ``max_new_tokens_limit``."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title="specserve", version=version, routes=app.routes)
    _, defs = models_json_schema(
        [(model, "validation") for model in BODIES.values()], ref_template="#/components/schemas/{model}"
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs["$defs"])
    components["ErrorResponse"] = ERROR_SCHEMA
    paths = schema["paths"]
    for path, model in BODIES.items():
        _narrow(components[model.__name__], model, max_tokens)
        paths[path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
        paths[path]["post"]["responses"] = {
            "200": {
                "description": "the completion; with stream, server-sent events ending in `data: [DONE]`",
                "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
            },
            **_errors("400", "401", "404", "413", "429", "499", "503", "504"),
        }
    paths["/v1/models"]["get"]["responses"] = {
        "200": {"description": "the served model", "content": {"application/json": {"schema": {"type": "object"}}}},
        **_errors("401"),
    }
    paths["/health"]["get"]["responses"] = {
        "200": {"description": "serving", "content": {"application/json": {"schema": {"type": "object"}}}},
        "503": {"description": "draining", "content": {"application/json": {"schema": {"type": "object"}}}},
    }
    paths["/version"]["get"]["responses"] = {
        "200": {"description": "the version", "content": {"application/json": {"schema": {"type": "object"}}}}
    }
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {}}}
    }
    app.openapi_schema = schema
    return schema
