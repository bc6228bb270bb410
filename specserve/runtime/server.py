"""The gRPC server lifecycle every role shares.

``create_server`` builds a ``grpc.aio`` server with the role's servicers, the
standard health service, server reflection, the :class:`ErrorInterceptor`
(domain errors -> precise status codes and trailers, :mod:`specserve.api.status`), message-size limits and optional
(mutual) TLS, binds it (port 0 picks a free port, for tests) and starts it.
``serve_until_signal`` runs it until SIGTERM/SIGINT, then: health NOT_SERVING,
the role's drain hook, ``stop(grace)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specserve.api.errors import InvalidArgument, SpecServeError
from specserve.api.status import status_code_for, trailers_for
from specserve.engine.model_thread import serial_torch_off_the_model_thread
from specserve.runtime import logs
from specserve.runtime.config import CommonSettings
from specserve.runtime.interceptors import RequestIdInterceptor

log = structlog.get_logger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_code_for(exc)
    if isinstance(exc, SpecServeError):
        context.set_trailing_metadata(trailers_for(exc))
        log.info("rpc_error", method=method, code=code.name, message=exc.message)
        await context.abort(code, exc.message)
    log.error("rpc_internal_error", method=method, exc_info=exc)
    await context.abort(code, f"internal error in {method}: {type(exc).__name__} (see server log)")


def _parser(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[Any], Any]:
    """Parse the raw request body inside the handler, so that bytes which are not a valid
    message become INVALID_ARGUMENT (grpc itself would answer UNKNOWN)."""

    def parse(raw: Any) -> Any:
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except Exception as exc:
            raise InvalidArgument(f"the request body is not a valid message for {method}: {exc}") from exc

    return parse


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps :class:`SpecServeError` to its status code; anything else is INTERNAL (a bug).

    It also parses the request body itself (the handler it returns takes raw bytes), so
    an undecodable body is INVALID_ARGUMENT rather than grpc's UNKNOWN.

    Streams: it writes each reply of a server-streaming handler itself. With
    ``stream_idle_timeout_s``, a write that cannot complete for that long (the client
    takes no message and its flow-control window stays full) ends the call: the
    handler's generator is closed (its clean-up runs, as on a client's cancellation) and
    the call is aborted with DEADLINE_EXCEEDED.
    """

    def __init__(self, *, stream_idle_timeout_s: float | None = None) -> None:
        self.stream_idle_timeout_s = stream_idle_timeout_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        parse = _parser(handler.request_deserializer, method)
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(parse(request), context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream
            timeout_s = self.stream_idle_timeout_s

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                try:
                    replies = inner_us(parse(request), context)
                    if not inspect.isasyncgen(replies):  # a handler that writes itself (health Watch)
                        await replies
                        return
                    async with contextlib.aclosing(replies):
                        async for reply in replies:
                            if not await _write(context, reply, timeout_s):
                                log.warning("stream_idle_timeout", method=method, timeout_s=timeout_s)
                                await replies.aclose()  # the handler's clean-up runs now
                                await context.abort(
                                    grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the client took no message for {timeout_s:g} s; the call was cancelled",
                                )
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
        return handler


async def _write(context: grpc.aio.ServicerContext, reply: Any, timeout_s: float | None) -> bool:
    """Write one reply of a stream; False when it could not be written within ``timeout_s``."""
    if timeout_s is None:
        await context.write(reply)
        return True
    try:
        # asyncio.timeout, not wait_for: the write runs in this task, so grpc's cancel of the call (the client
        # left) arrives as CancelledError; wait_for would hand back the failed write's error instead (an
        # ExecuteBatchError, logged as an internal error once per cancelled stream).
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout_s):
                await context.write(reply)
        else:  # pragma: no cover - Python 3.10
            await asyncio.wait_for(context.write(reply), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


@dataclass(frozen=True)
class Registration:
    """One servicer to host: ``add_fn(servicer, server)`` and its full service name."""

    add_fn: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    service_name: str


@dataclass
class RunningServer:
    """A started server: its bound port and the handles needed to stop it cleanly."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    drain: Callable[[], Awaitable[None]] | None = None
    _stopped: bool = field(default=False, repr=False)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, drain, then stop accepting and wait up to ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.drain is not None:
            try:
                await asyncio.wait_for(self.drain(), timeout=grace)
            except asyncio.TimeoutError:
                log.warning("drain_timeout", grace_s=grace)
        await self.server.stop(grace)


def server_credentials(settings: CommonSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from settings; with ``tls_ca_file`` client certificates are required."""
    if not settings.tls_enabled:
        return None
    assert settings.tls_cert_file is not None and settings.tls_key_file is not None
    key = settings.tls_key_file.read_bytes()
    cert = settings.tls_cert_file.read_bytes()
    ca = settings.tls_ca_file.read_bytes() if settings.tls_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


#: Clients may ping this often without data (the coordinator's worker channels ping every 30 s).
MIN_CLIENT_PING_INTERVAL_MS = 10_000


def server_options(settings: CommonSettings) -> list[tuple[str, int]]:
    """Message limits and HTTP/2 keepalive: the server pings every connection each
    ``keepalive_time_s`` (data or not) and closes one that does not answer in ``keepalive_timeout_s``."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        # grpc 1.6x+ waits this long for any ping's ack (60 s by default), keepalive pings included.
        ("grpc.http2.ping_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", int(settings.keepalive_time_s * 1000)),
    ]


async def create_server(
    settings: CommonSettings,
    registrations: Sequence[Registration],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    drain: Callable[[], Awaitable[None]] | None = None,
    stream_idle_timeout_s: float | None = None,
) -> RunningServer:
    """Build, bind and start a server for ``registrations`` on ``settings.host:settings.port``.

    ``stream_idle_timeout_s``: see :class:`ErrorInterceptor` (None: a stream may wait for its client forever).
    """
    options = server_options(settings)
    chain = [RequestIdInterceptor(), *interceptors, ErrorInterceptor(stream_idle_timeout_s=stream_idle_timeout_s)]
    server = grpc.aio.server(interceptors=chain, options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(r.service_name for r in registrations)
    for reg in registrations:
        reg.add_fn(reg.servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    creds = server_credentials(settings)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("server_started", address=f"{settings.host}:{port}", services=list(names), tls=creds is not None)
    return RunningServer(server=server, port=port, health=health_servicer, service_names=names, drain=drain)


async def serve_until_signal(running: RunningServer, *, grace: float) -> None:
    """Block until SIGTERM or SIGINT, then stop ``running`` gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    waiter = asyncio.create_task(running.server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stopper in done:
        log.info("shutdown_requested", grace_s=grace)
        await running.stop(grace)
    for task in (waiter, stopper):
        task.cancel()


def start_metrics_server(port: int | None, host: str = "0.0.0.0") -> int | None:
    """Expose the default Prometheus registry on ``http://host:port/metrics``; returns the bound port."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    http_server, _thread = start_http_server(port, addr=host)
    bound = http_server.server_port
    log.info("metrics_started", port=bound)
    return bound


class RoleApp(Protocol):
    """What a role's ``start_*`` returns: its running server and a clean stop."""

    running: RunningServer | None

    async def stop(self, grace: float | None = None) -> None: ...


async def run_role(settings: CommonSettings, start: Callable[[], Awaitable[RoleApp]]) -> None:
    """The ``serve()`` of every role: logging, start, ``/metrics``, run until SIGTERM/SIGINT, stop."""
    logs.configure_logging(settings.log_format, settings.log_level, secrets=logs.settings_secrets(settings))
    app = await start()
    serial_torch_off_the_model_thread()  # after the model thread took its thread count (start loads it there)
    start_metrics_server(settings.metrics_port, settings.host)
    try:
        assert app.running is not None
        await serve_until_signal(app.running, grace=settings.shutdown_grace_s)
    finally:
        try:
            await app.stop()
        except Exception:
            log.exception("stop_failed")
