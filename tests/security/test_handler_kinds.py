"""Authentication and request ids cover every kind of gRPC handler, not only the two the services use today.

A real server from ``specserve.runtime.server.create_server`` (the interceptor chain every role runs) on
a loopback port, with a bearer-token interceptor and one method of each kind: unary-unary, unary-stream,
stream-unary (client streaming) and stream-stream (bidirectional). Each answers with the request id
bound to its log context, so the test also sees that id cleaned as at every other ingress.
"""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
import structlog

from specserve.runtime.config import CommonSettings
from specserve.runtime.interceptors import MAX_REQUEST_ID_CHARS, BearerTokenInterceptor
from specserve.runtime.server import Registration, create_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

TOKEN = "kinds-token"
SERVICE = "specserve.test.Kinds"


def _bound_id() -> bytes:
    return (structlog.contextvars.get_contextvars().get("request_id") or "").encode()


async def _unary_unary(request: bytes, context) -> bytes:
    return _bound_id()


async def _unary_stream(request: bytes, context):
    yield _bound_id()
    yield _bound_id()


async def _stream_unary(requests, context) -> bytes:
    async for _ in requests:
        pass
    return _bound_id()


async def _stream_stream(requests, context):
    async for _ in requests:
        yield _bound_id()


def _add(servicer: object, server: grpc.aio.Server) -> None:
    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def address():
    settings = CommonSettings(host="127.0.0.1", port=0)
    running = await create_server(
        settings, [Registration(_add, None, SERVICE)], interceptors=[BearerTokenInterceptor([TOKEN])]
    )
    yield f"127.0.0.1:{running.port}"
    await running.stop(0)


async def _call(channel: grpc.aio.Channel, kind: str, metadata, messages=(b"x", b"y")) -> list[bytes]:
    """Call method ``kind`` with ``messages`` where it streams its requests (``b"x"`` where it takes one); its
    replies. A call the server refuses at its start is sent no messages: a message written after the refusal
    can fail on the client's side first (INTERNAL, "Internal error from Core"), hiding the server's status."""
    method = f"/{SERVICE}/{kind}"
    if kind == "UnaryUnary":
        return [await channel.unary_unary(method)(b"x", metadata=metadata, timeout=60)]
    if kind == "UnaryStream":
        return [reply async for reply in channel.unary_stream(method)(b"x", metadata=metadata, timeout=60)]
    if kind == "StreamUnary":
        return [await channel.stream_unary(method)(iter(messages), metadata=metadata, timeout=60)]
    call = channel.stream_stream(method)(iter(messages), metadata=metadata, timeout=60)
    return [reply async for reply in call]


KINDS = ["UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_handler_kind_needs_the_token(address, kind):
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await _call(channel, kind, (), messages=())
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await _call(channel, kind, (("authorization", "Bearer guess"),), messages=())
        assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
        replies = await _call(channel, kind, (("authorization", f"Bearer {TOKEN}"), ("x-request-id", "id-1")))
        assert replies and set(replies) == {b"id-1"}


@pytest.mark.parametrize("kind", KINDS)
async def test_every_handler_kind_binds_a_cleaned_request_id(address, kind):
    given = "q " + "q" * 7000  # under gRPC's 8 KiB soft metadata limit; a space is no part of an id
    metadata = (("authorization", f"Bearer {TOKEN}"), ("x-request-id", given))
    async with grpc.aio.insecure_channel(address) as channel:
        replies = await _call(channel, kind, metadata)
    assert set(replies) == {b"q" * MAX_REQUEST_ID_CHARS}
