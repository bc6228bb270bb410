"""The shared server lifecycle: error mapping, health, reflection, graceful stop."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from waiting import wait_until

from specserve.api import errors
from specserve.api.status import ERROR_CLASS_KEY, RETRY_AFTER_KEY, status_code_for
from specserve.runtime.config import CommonSettings
from specserve.runtime.server import Registration, create_server

SERVICE = "test.Raiser"


class Raiser:
    """A servicer whose one method raises the error class named in the request."""

    async def Raise(self, request: bytes, context) -> bytes:
        name = request.decode()
        if name == "ok":
            return b"fine"
        if name == "bug":
            raise KeyError("a bug")
        cls = {c.__name__: c for c in errors.all_error_classes()}[name]
        raise cls(f"{name} happened", retry_after_s=2.5 if name == "ResourceExhausted" else None)


def add_raiser(servicer: Raiser, server) -> None:
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Raise": grpc.unary_unary_rpc_method_handler(servicer.Raise)}
    )
    server.add_generic_rpc_handlers((handler,))


@pytest.fixture
async def running():
    settings = CommonSettings(host="127.0.0.1", port=0)
    server = await create_server(settings, [Registration(add_raiser, Raiser(), SERVICE)])
    yield server
    await server.stop(0)


async def call(port: int, name: str):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await channel.unary_unary(f"/{SERVICE}/Raise")(name.encode())


@pytest.mark.system
@pytest.mark.parametrize("cls", errors.all_error_classes()[1:], ids=lambda c: c.__name__)
async def test_every_domain_error_maps_to_its_status(running, cls):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(running.port, cls.__name__)
    assert info.value.code() == grpc.StatusCode[cls.grpc_code_name]
    assert info.value.code() != grpc.StatusCode.INTERNAL
    assert info.value.details() == f"{cls.__name__} happened"
    assert dict(info.value.trailing_metadata())[ERROR_CLASS_KEY] == cls.__name__


@pytest.mark.unit
def test_every_error_class_names_a_real_non_ok_code():
    for cls in errors.all_error_classes()[1:]:
        code = status_code_for(cls("x"))
        assert code not in (grpc.StatusCode.OK, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), cls


@pytest.mark.system
async def test_retry_hint_travels_in_trailing_metadata(running):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(running.port, "ResourceExhausted")
    assert dict(info.value.trailing_metadata())[RETRY_AFTER_KEY] == "2.5"


@pytest.mark.system
async def test_a_bug_is_internal_and_the_server_keeps_serving(running):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(running.port, "bug")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in info.value.details()
    assert await call(running.port, "ok") == b"fine"


@pytest.mark.system
async def test_health_reflection_and_graceful_stop(running):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listing = [
            r
            async for r in stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        ]
        names = {s.name for s in listing[0].list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names

        drained = []

        async def drain():
            drained.append(True)

        running.drain = drain
        await running.stop(0.5)
        assert drained == [True]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.system
async def test_bearer_token_interceptor_codes():
    from specserve.runtime.interceptors import BearerTokenInterceptor

    settings = CommonSettings(host="127.0.0.1", port=0)
    server = await create_server(
        settings,
        [Registration(add_raiser, Raiser(), SERVICE)],
        interceptors=[BearerTokenInterceptor(["s3cret"])],
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            method = channel.unary_unary(f"/{SERVICE}/Raise")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(b"ok")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(b"ok", metadata=(("authorization", "Bearer wrong"),))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert await method(b"ok", metadata=(("authorization", "Bearer s3cret"),)) == b"fine"
            # Probes stay open.
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.system
async def test_mutual_tls_refuses_plaintext_and_certless_clients(pki):
    settings = CommonSettings(
        host="127.0.0.1",
        port=0,
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_ca_file=pki.ca,
    )
    server = await create_server(settings, [Registration(add_raiser, Raiser(), SERVICE)])
    target = f"localhost:{server.port}"
    ca = pki.ca.read_bytes()
    try:
        # Plaintext cannot connect to a TLS port.
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary(f"/{SERVICE}/Raise")(b"ok", timeout=3)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # TLS without a client certificate is refused by mutual TLS.
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary(f"/{SERVICE}/Raise")(b"ok", timeout=3)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # A certificate from another CA is refused too.
        rogue = grpc.ssl_channel_credentials(
            ca, pki.rogue_client.key.read_bytes(), pki.rogue_client.cert.read_bytes()
        )
        async with grpc.aio.secure_channel(target, rogue) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await channel.unary_unary(f"/{SERVICE}/Raise")(b"ok", timeout=3)
        # The coordinator's certificate gets through.
        good = grpc.ssl_channel_credentials(ca, pki.client.key.read_bytes(), pki.client.cert.read_bytes())
        async with grpc.aio.secure_channel(target, good) as channel:
            assert await channel.unary_unary(f"/{SERVICE}/Raise")(b"ok", timeout=5) == b"fine"
    finally:
        await server.stop(0)


@pytest.mark.unit
def test_tls_settings_are_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file"):
        CommonSettings(tls_cert_file="/x.crt")
    with pytest.raises(ValidationError, match="mutual TLS"):
        CommonSettings(tls_ca_file="/ca.crt")


STREAM_SERVICE = "test.Counter"


class Counter:
    """A servicer whose one stream writes a message every millisecond until the call ends."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def Count(self, request: bytes, context):
        try:
            i = 0
            while True:
                yield str(i).encode()
                i += 1
                await asyncio.sleep(0.001)
        finally:
            self.closed.set()


@pytest.mark.system
async def test_a_stream_the_client_cancels_is_not_logged_as_a_bug():
    """The writes after a client's cancel fail inside grpc; that is the client leaving, not an
    internal error (found by the soak: one ``rpc_internal_error`` per cancelled stream)."""
    counter = Counter()

    def add(servicer: Counter, server) -> None:
        handler = grpc.method_handlers_generic_handler(
            STREAM_SERVICE, {"Count": grpc.unary_stream_rpc_method_handler(servicer.Count)}
        )
        server.add_generic_rpc_handlers((handler,))

    server = await create_server(
        CommonSettings(host="127.0.0.1", port=0),
        [Registration(add, counter, STREAM_SERVICE)],
        stream_idle_timeout_s=30.0,  # as the coordinator serves Generate
    )
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(20):
                counter.closed.clear()
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                    call = channel.unary_stream(f"/{STREAM_SERVICE}/Count")(b"")
                    seen = 0
                    async for _reply in call:
                        seen += 1
                        if seen == 3:
                            call.cancel()
                            break
                    await wait_until(counter.closed.is_set, timeout_s=10, what="the stream's clean-up")
        assert [e for e in logs if e["log_level"] == "error"] == []
    finally:
        await server.stop(0)
