"""The OpenAI-compatible HTTP API of the coordinator (FastAPI).

The routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/version``,
``/openapi.json``, ``/metrics``) drive the same domain object as the gRPC servicer, in the same order: the
body read strictly (:mod:`specserve.coordinator.json_body`) and turned into one ``GenerateRequest`` per choice
(:mod:`specserve.coordinator.openai_protocol`), ``Coordinator.admit`` for all ``n`` at once,
``Coordinator.parse``, then one session per place (:class:`~specserve.coordinator.choices.Choices`); the reply
waits for every choice's first event, so an error before any token still gets its HTTP status. The contract
(fields, errors and their statuses, authentication, cancellation): docs/operations.md, "The OpenAI-compatible
HTTP API".
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.api import errors
from specserve.coordinator.admission import Place
from specserve.coordinator.cache_scope import http_tenant
from specserve.coordinator.choices import Choices
from specserve.coordinator.clients import FORWARDED_FOR, TLS_CLIENT_NAME
from specserve.coordinator.coordinator import Coordinator
from specserve.coordinator.json_body import read_json
from specserve.coordinator.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    bad_param,
    check_prompt_size,
    parse_body,
)
from specserve.coordinator.openai_replies import ReplyBuilder, TokenStrings
from specserve.coordinator.openapi import openapi_schema
from specserve.coordinator.requests import GenerationRequest
from specserve.runtime.interceptors import REQUEST_ID_KEY, BearerTokens, bearer_token, clean_request_ids

log = structlog.get_logger(__name__)

#: A body larger than this (bytes) is parsed and validated on a worker thread, off the event loop.
PARSE_ON_LOOP_BYTES = 64 * 1024

#: HTTP status of each domain error, by the gRPC code its class names (errors.py).
HTTP_STATUS: dict[str, int] = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "NOT_FOUND": 404,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "CANCELLED": 499,
    "INTERNAL": 500,
}
#: OpenAI's error ``type`` for each status.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def http_status(exc: errors.SpecServeError) -> int:
    return getattr(exc, "http_status", None) or HTTP_STATUS.get(exc.grpc_code_name, 500)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(exc: errors.SpecServeError) -> JSONResponse:
    status = http_status(exc)
    headers = {}
    if exc.retry_after_s is not None and status in (429, 503):
        # Retry-After takes whole seconds (RFC 9110); retry-after-ms (read by OpenAI's SDKs) the precise wait.
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(exc.retry_after_s * 1000)))
    code = getattr(exc, "openai_code", None) or type(exc).__name__
    body = error_body(status, exc.message, param=getattr(exc, "param", None), code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that notice a client going away even between events.

    It listens for ``http.disconnect`` while streaming (whatever ASGI version the
    server speaks), stops the stream when it arrives, and always calls
    ``on_close`` at the end: that cancels the request's sessions if still running.
    """

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None], headers: dict) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stream.cancel()
            listen.cancel()
            self._on_close()
        if stream in done and not stream.cancelled():
            exc = stream.exception()
            if exc is not None and not isinstance(exc, OSError):  # OSError: the client went away
                raise exc


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    """The routes' logic, bound to one :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator, *, model_name: str, auth_tokens: Sequence[str] = ()) -> None:
        self.coordinator = coordinator
        self.model_name = model_name
        self.created = int(time.time())
        self._tokens = BearerTokens(auth_tokens) if auth_tokens else None
        self.token_strings = TokenStrings(coordinator.tokenizer)  # logprobs' token texts and bytes
        self.draining = False
        #: ``GET /version``: the installed distribution's version.
        self.version = _installed_version()

    # ---- per request --------------------------------------------------------------------
    def authorize(self, request: Request) -> str | None:
        """The caller's name for per-client limits (None: unnamed); Unauthenticated (401) without a valid key.

        Also binds ``request_id`` (the ``x-request-id`` header through ``clean_request_ids``, as over
        gRPC, or a new id) and the path to the log context, so the sessions' log events carry them
        (and the workers' too, as over gRPC).
        """
        given = clean_request_ids(request.headers.getlist(REQUEST_ID_KEY))
        structlog.contextvars.bind_contextvars(request_id=given or uuid.uuid4().hex, rpc=request.url.path)
        header = request.headers.get("authorization")
        token = bearer_token([("authorization", header)] if header is not None else [])
        if self._tokens is not None:
            if token is None:
                exc = errors.Unauthenticated(
                    "missing API key: send the header 'Authorization: Bearer <key>' with one of the "
                    "server's tokens"
                )
                exc.openai_code = "missing_api_key"  # type: ignore[attr-defined]
                raise exc
            if not token or not self._tokens.accepts(token):
                exc = errors.Unauthenticated("the API key is not accepted")
                exc.openai_code = "invalid_api_key"  # type: ignore[attr-defined]
                raise exc
        return self.coordinator.clients.key(
            token=token,
            certificate=request.scope.get("state", {}).get(TLS_CLIENT_NAME),
            peer=request.client.host if request.client else "unknown",
            forwarded_for=request.headers.getlist(FORWARDED_FOR),
        )

    async def read_body(self, request: Request) -> bytes:
        """The body, refused (413) past ``max_message_bytes``, the gRPC API's message limit."""
        limit = self.coordinator.settings.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            exc = errors.NotFound(f"The model `{model}` does not exist; this server serves `{self.model_name}`")
            exc.param = "model"  # type: ignore[attr-defined]
            exc.openai_code = "model_not_found"  # type: ignore[attr-defined]
            raise exc

    async def generate(
        self, request: Request, cls: type[CompletionRequest] | type[ChatCompletionRequest]
    ) -> Any:
        """One completion or chat request: every check, then the sessions, then the reply."""
        client = self.authorize(request)
        body, parsed, places = await self.admit(request, cls, client)
        tenant = http_tenant(request.headers.get("authorization"), by_token=self._tokens is not None)
        choices = Choices(self.coordinator, parsed, places, tenant=tenant)  # each place released when its session ends
        headers = {REQUEST_ID_KEY: structlog.contextvars.get_contextvars().get("request_id", "")}
        try:
            options = body.reply_options()
            builder = ReplyBuilder(
                "chat" if cls is ChatCompletionRequest else "completion",
                model=self.model_name,
                n=body.n,
                options=options,
                prompt_tokens=len(parsed[0].prompt_token_ids),
                token_strings=self.token_strings if options.logprobs else None,
            )
            await choices.first_events()  # an error before the first token keeps its status
        except BaseException:
            choices.cancel()
            raise
        if body.stream:
            return EventStreamResponse(_stream(choices, builder), on_close=choices.cancel, headers=headers)
        collect = asyncio.ensure_future(_collect(choices, builder))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or this handler was cancelled)
                choices.cancel()
                collect.cancel()
        if collect.cancelled():
            log.info("http_client_gone")
            return JSONResponse(error_body(499, "the client closed the request"), status_code=499)
        return JSONResponse(collect.result(), headers=headers)

    async def admit(
        self, request: Request, cls: type[CompletionRequest] | type[ChatCompletionRequest], client: str | None
    ) -> tuple[CompletionRequest | ChatCompletionRequest, list[GenerationRequest], list[Place]]:
        """Read and validate the body, take the places of all its choices (and their rate tokens) at
        once, then check each choice as a gRPC request would be. Nothing is held or running when this
        raises."""
        if self.draining:
            raise errors.Unavailable(
                "this coordinator is shutting down; send the request to another replica", retry_after_s=1.0
            )
        data = await self.read_body(request)  # refused past max_message_bytes before any parsing
        if len(data) > PARSE_ON_LOOP_BYTES:  # a large body is parsed and validated on a worker thread
            body = await asyncio.to_thread(self.parse, cls, data)
        else:
            body = self.parse(cls, data)
        settings = self.coordinator.settings
        limit = min(settings.max_sessions_per_client, settings.max_sessions, settings.session_burst_per_client)
        if body.n > limit:
            raise bad_param("n", f"n={body.n} is above this server's limit of {limit} sessions per request")
        places = self.coordinator.admit(client, sessions=body.n)  # before any tokenizing or compiling
        try:
            first = await self.coordinator.parse(*body.generation(0), client=client)  # the prompt is tokenized once for all n
        except BaseException:
            for place in places:
                place.release()
            raise
        parsed = [first, *(first.with_seed(body.choice_seed(i)) for i in range(1, body.n))]
        return body, parsed, places

    def parse(
        self, cls: type[CompletionRequest] | type[ChatCompletionRequest], data: bytes
    ) -> CompletionRequest | ChatCompletionRequest:
        """The body as a request, checked: JSON, the prompt's size before validation builds it, the
        fields, the model, what is supported. Pure CPU work: :meth:`admit` runs it off the loop when
        the body is large."""
        raw = read_json(data)
        settings = self.coordinator.settings
        check_prompt_size(raw, max_tokens=settings.max_prompt_tokens, max_bytes=settings.max_prompt_bytes)
        body = parse_body(cls, raw, unknown_fields=settings.http_unknown_fields)
        self.check_model(body.model)
        body.check_supported()
        return body


def _installed_version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _too_large(limit: int) -> errors.ResourceExhausted:
    exc = errors.ResourceExhausted(f"the request body is larger than this server's limit of {limit} bytes")
    exc.http_status = 413  # type: ignore[attr-defined]
    exc.openai_code = "request_too_large"  # type: ignore[attr-defined]
    return exc


async def _collect(choices: Choices, builder: ReplyBuilder) -> dict[str, Any]:
    async for index, event in choices.events():
        if isinstance(event, BaseException):
            choices.cancel()
            raise event
        builder.on_event(index, event)
    return builder.reply()


async def _stream(choices: Choices, builder: ReplyBuilder) -> AsyncIterator[str]:
    async for index, event in choices.events():
        if isinstance(event, BaseException):
            choices.cancel()
            if not isinstance(event, errors.SpecServeError):
                log.error("http_stream_internal_error", exc_info=event)
                event = errors.SpecServeError(f"internal error: {type(event).__name__} (see server log)")
            yield _sse(error_body(http_status(event), event.message, code=type(event).__name__))
            yield "data: [DONE]\n\n"
            return
        for payload in builder.on_event(index, event):
            yield _sse(payload)
    if builder.include_usage:
        yield _sse(builder.usage_chunk())
    yield "data: [DONE]\n\n"


def create_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI application serving :class:`OpenAIServer`'s routes."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi_schema(  # type: ignore[method-assign]
        app, version=server.version, max_tokens=server.coordinator.settings.max_new_tokens_limit
    )

    @app.exception_handler(errors.SpecServeError)
    async def domain_error(request: Request, exc: errors.SpecServeError) -> JSONResponse:
        log.info("http_error", path=request.url.path, status=http_status(exc), message=exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), code="invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("http_internal_error", path=request.url.path, exc_info=exc)
        message = f"internal error: {type(exc).__name__} (see server log)"
        return JSONResponse(error_body(500, message), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": server.version})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.authorize(request)
        model = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "specserve"}
        return JSONResponse({"object": "list", "data": [model]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await server.generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await server.generate(request, ChatCompletionRequest)

    return app
