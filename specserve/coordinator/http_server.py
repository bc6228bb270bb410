"""Running the HTTP API (uvicorn) inside the coordinator's event loop.

:func:`start_http` binds ``settings.host:settings.http_port`` itself (port 0
picks a free one, as for gRPC; a busy port fails at once with the address in
the message), serves :func:`specserve.coordinator.http_api.create_app` with uvicorn as a
task of the running loop, and returns an :class:`HttpServer`. The coordinator's
TLS settings apply here as well (``tls_ca_file`` requires client
certificates, whose name each request then carries for the per-client limits:
:data:`specserve.coordinator.clients.TLS_CLIENT_NAME` in its ASGI state). Signals stay with the role: uvicorn's own handlers are not
installed, and :meth:`HttpServer.stop` is called by ``CoordinatorApp.stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specserve.coordinator.clients import TLS_CLIENT_NAME, certificate_name
from specserve.coordinator.coordinator import Coordinator
from specserve.coordinator.http_api import OpenAIServer, create_app
from specserve.runtime.config import CoordinatorSettings

log = structlog.get_logger(__name__)

#: How long start-up waits for uvicorn to report that it serves.
START_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the role's SIGTERM handling stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        pass


def _naming_protocol(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``base``, with each request's ASGI state carrying the name on the connection's
    verified client certificate (uvicorn copies ``app_state`` into every request's scope)."""

    class NamingProtocol(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            cert = ssl_object.getpeercert() if ssl_object is not None else None
            if cert:
                common = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
                dns = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
                name = certificate_name(common, dns)
                if name is not None:
                    self.app_state = {**self.app_state, TLS_CLIENT_NAME: name}

    return NamingProtocol


@dataclass
class HttpServer:
    """A running HTTP API: its routes' state, the uvicorn server, and where it listens."""

    api: OpenAIServer
    server: uvicorn.Server
    task: asyncio.Task
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (what ``OPENAI_BASE_URL`` should be)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return self.api.model_name

    def begin_drain(self) -> None:
        """From now on ``/health`` is 503 and new generation requests are refused with 503 (retry
        elsewhere); requests in progress go on. The gRPC side's NOT_SERVING, for HTTP."""
        self.api.draining = True

    async def stop(self, grace: float) -> None:
        """Drain, then stop: for up to ``grace`` seconds the listener stays open and answers new
        requests and ``/health`` with 503 (so a client or a load balancer reads "go elsewhere",
        never a reset connection) while the coordinator's sessions run to their end; then uvicorn
        closes the listener and lets the last responses finish within what is left of ``grace``."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.api.coordinator.drain()), timeout=grace)
        self.server.config.timeout_graceful_shutdown = max(deadline - loop.time(), 0.1)
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=grace + 5.0)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            log.warning("http_stop_timeout", grace_s=grace)


def served_model_name(settings: CoordinatorSettings, tokenizer: Any) -> str:
    """``served_model_name``, or the name of the tokenizer's directory."""
    if settings.served_model_name:
        return settings.served_model_name
    return Path(str(getattr(tokenizer, "name_or_path", "") or "")).name or "specserve"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind the HTTP API to {host}:{port} ({exc.strerror or exc})") from exc
    return sock


async def start_http(coordinator: Coordinator, settings: CoordinatorSettings) -> HttpServer:
    """Serve the OpenAI API of ``coordinator`` on ``settings.host:settings.http_port``."""
    assert settings.http_port is not None
    api = OpenAIServer(
        coordinator,
        model_name=served_model_name(settings, coordinator.tokenizer),
        auth_tokens=[t.get_secret_value() for t in settings.auth_tokens],
    )
    tls: dict[str, Any] = {}
    if settings.tls_enabled:
        tls = {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
        if settings.tls_ca_file is not None:
            tls.update(ssl_ca_certs=str(settings.tls_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
            tls["http"] = _naming_protocol(AutoHTTPProtocol)
    config = uvicorn.Config(
        create_app(api),
        log_config=None,
        access_log=False,
        lifespan="off",
        ws="none",
        proxy_headers=False,  # X-Forwarded-For is read by specserve/coordinator/clients.py, from trusted_proxies only
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        **tls,
    )
    sock = _bind(settings.host, settings.http_port)
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise OSError(f"the HTTP API on {settings.host}:{settings.http_port} stopped during start-up")
        if asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            raise OSError(f"the HTTP API on {settings.host}:{settings.http_port} did not start")
        await asyncio.sleep(0.01)
    port = sock.getsockname()[1]
    http = HttpServer(api=api, server=server, task=task, host=settings.host, port=port, tls=bool(tls))
    log.info("http_api_started", url=http.url, model=api.model_name, auth=bool(settings.auth_tokens))
    return http
