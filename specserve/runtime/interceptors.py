"""Server interceptors: bearer-token and client-certificate authentication, request-id propagation.

* :class:`BearerTokenInterceptor` guards the coordinator's client API (the
  clients' tokens; the HTTP API checks the same :class:`BearerTokens`) and the
  workers (the one shared worker token). A call
  without ``authorization: Bearer <token>`` is UNAUTHENTICATED; a call whose
  token is not one of the configured ones is PERMISSION_DENIED. Health checks
  and reflection stay open so probes and tooling work. Tokens are compared in
  constant time and never logged.
* :class:`ClientCertificateInterceptor` pins mutual TLS to client identities:
  the CA's signature is checked by the TLS handshake, the name (common name or
  DNS subject alternative name) here; another name is PERMISSION_DENIED.
* :class:`RequestIdInterceptor` takes ``x-request-id`` from the call's metadata
  (or makes one) and binds it, with the method, to structlog's context for the
  duration of the call, so one request can be followed across all three roles:
  callers forward it with :func:`outgoing_metadata`. Ids are cleaned at every
  ingress (:func:`clean_request_ids`: printable ASCII, at most
  :data:`MAX_REQUEST_ID_CHARS` each, at most :data:`MAX_REQUEST_IDS_CHARS` for the
  comma-joined ids of one batched call), so no client's id can push a batched
  call past gRPC's metadata limit (16 KiB) and fail its batch-mates.

Every wrapper covers all four handler kinds (unary-unary, unary-stream,
stream-unary, stream-stream): a handler kind added later is not left unguarded.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
import structlog

REQUEST_ID_KEY = "x-request-id"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


#: Longest request id kept from a caller, in characters; a longer one is cut to this.
MAX_REQUEST_ID_CHARS = 128
#: Longest comma-joined value of a batched call's request ids (gRPC refuses metadata over 16 KiB);
#: ids past it are left out and counted (``+N``).
MAX_REQUEST_IDS_CHARS = 4096


def clean_request_ids(ids: str | Sequence[str | None] | None) -> str | None:
    """Request ids as they may travel and be logged: ``ids`` (one metadata value, comma-separated ids,
    or a sequence of such values) split on commas, each id kept to printable ASCII without spaces and
    cut to :data:`MAX_REQUEST_ID_CHARS`, duplicates and empties dropped, joined with commas up to
    :data:`MAX_REQUEST_IDS_CHARS` (the ids past it become ``+N``). None when nothing is left."""
    values = [ids] if isinstance(ids, str) or ids is None else ids
    kept: dict[str, None] = {}
    for value in values:
        for part in (value or "").split(","):
            clean = "".join(c for c in part if "!" <= c <= "~")[:MAX_REQUEST_ID_CHARS]
            if clean:
                kept[clean] = None
    ordered = list(kept)
    out: list[str] = []
    size = -1  # the length of ",".join(out)
    for i, request_id in enumerate(ordered):
        after = len(ordered) - i - 1
        marker = len(f",+{after}") if after else 0  # room kept for the count of the ids left out
        if size + 1 + len(request_id) + marker > MAX_REQUEST_IDS_CHARS:
            return ",".join([*out, f"+{after + 1}"])
        out.append(request_id)
        size += 1 + len(request_id)
    return ",".join(out) or None


def _wrap(
    handler: grpc.RpcMethodHandler,
    before: Callable[[grpc.aio.ServicerContext], Awaitable[None]],
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` that runs ``before(context)`` first (it may abort), for every handler kind."""
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await before(context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):  # a handler that writes its replies itself

            async def unary_stream_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                await before(context)
                await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_writer, handler.request_deserializer, handler.response_serializer
            )

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await before(context)
            async for reply in inner_stream(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary is not None:
        inner_client_stream = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            await before(context)
            return await inner_client_stream(requests, context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_stream is not None:
        inner_bidi = handler.stream_stream
        if not inspect.isasyncgenfunction(inner_bidi):

            async def stream_stream_writer(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
                await before(context)
                await inner_bidi(requests, context)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream_writer, handler.request_deserializer, handler.response_serializer
            )

        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await before(context)
            async for reply in inner_bidi(requests, context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, handler.request_deserializer, handler.response_serializer
        )
    raise TypeError(f"a gRPC method handler of no known kind: {handler!r}")


def token_fingerprint(token: str) -> str:
    """A short, non-reversible id of a token, safe to log and to key per-client limits on."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return None


def peer_host(peer: str) -> str:
    """The host of a caller: a gRPC peer's address (``ipv4:1.2.3.4:5678`` -> ``1.2.3.4``,
    ``ipv6:%5B2001:db8::1%5D:5678`` -> ``2001:db8::1``, without a zone id), or ``peer`` itself (the HTTP
    API's bare ``1.2.3.4``; a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    return peer.strip("[]")


def peer_key(peer: str) -> str:
    """The per-client key of a caller by its address: a gRPC peer (``ipv4:1.2.3.4:5678``,
    ``ipv6:%5B2001:db8::1%5D:5678``) or a bare address (the HTTP API's ``1.2.3.4``, ``::1``).

    IPv4: the address. IPv6: its /64 network, the block one subscriber usually holds, so one
    client cannot take a fresh limit per address it picks (an IPv4-mapped address is its IPv4
    address). Anything else (a Unix socket): the peer string itself.
    """
    host = peer_host(peer)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"peer:{host}"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return f"peer:{address.ipv4_mapped}"
        return f"peer:{ipaddress.IPv6Network((address, 64), strict=False)}"
    return f"peer:{address}"


class BearerTokens:
    """The accepted bearer tokens; :meth:`accepts` compares in constant time."""

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens:
            raise ValueError("BearerTokens needs at least one token")
        self._tokens = tuple(t.encode() for t in tokens)

    def accepts(self, token: str) -> bool:
        given = token.encode()
        return any(hmac.compare_digest(given, t) for t in self._tokens)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls carrying one of ``tokens`` as ``authorization: Bearer <token>``."""

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens:
            raise ValueError("BearerTokenInterceptor needs at least one token")
        self._tokens = BearerTokens(tokens)

    def _valid(self, token: str) -> bool:
        return self._tokens.accepts(token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler

        async def check(context: grpc.aio.ServicerContext) -> None:
            token = bearer_token(context.invocation_metadata())
            if token is None:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing credentials: send metadata 'authorization: Bearer <token>'",
                )
            elif not token or not self._valid(token):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the bearer token is not accepted")

        return _wrap(handler, check)


class ClientCertificateInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls whose (verified) client certificate names one of ``names``: CN or DNS SAN."""

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise ValueError("ClientCertificateInterceptor needs at least one name")
        self._names = frozenset(names)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler

        async def check(context: grpc.aio.ServicerContext) -> None:
            presented = certificate_names(context.auth_context())
            if not presented:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "this server needs a client certificate (mutual TLS)"
                )
            elif not presented & self._names:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, "the client certificate's name is not allowed here"
                )

        return _wrap(handler, check)


def certificate_names(auth_context: Mapping[str, Sequence[bytes]] | None) -> set[str]:
    """The names a verified client certificate carries: its common name and DNS subject alternative names."""
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in (auth_context or {}).get(key, ()):
            names.add(value.decode() if isinstance(value, bytes) else str(value))
    return names


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Binds ``request_id`` (``x-request-id`` through :func:`clean_request_ids`, or new) and ``rpc`` to
    structlog's context."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]

        async def bind(context: grpc.aio.ServicerContext) -> None:
            given = [
                value if isinstance(value, str) else value.decode("ascii", "replace")
                for key, value in context.invocation_metadata() or ()
                if key == REQUEST_ID_KEY
            ]
            request_id = clean_request_ids(given)
            structlog.contextvars.bind_contextvars(request_id=request_id or uuid.uuid4().hex, rpc=method)

        return _wrap(handler, bind)


def current_request_id() -> str | None:
    return structlog.contextvars.get_contextvars().get("request_id")


def outgoing_metadata(extra: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """Metadata for a call to another role that carries the current request id."""
    request_id = current_request_id()
    head = ((REQUEST_ID_KEY, request_id),) if request_id else ()
    return (*head, *extra)
