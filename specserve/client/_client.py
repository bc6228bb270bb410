"""The SDK's implementation; the public names and their documentation are :mod:`specserve.client`."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from specserve.api import errors
from specserve.api.params import PositionLogprobs
from specserve.api.stats import GenerationStats
from specserve.api.status import error_from_rpc
from specserve.client._methods import AsyncClientMethods, ClientMethods
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

#: The longest server retry hint the SDK waits out before retrying RESOURCE_EXHAUSTED (OpenAI's SDKs wait
#: up to 60 s too); a longer one is raised at once, for the caller to decide.
RATE_LIMIT_MAX_WAIT_S = 60.0

# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class StreamChunk:
    """Tokens that just committed, and their text (a split multi-byte character waits until whole).

    ``logprobs``: with ``logprobs=True``, one :class:`PositionLogprobs` per token, else ``()``.
    """

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[PositionLogprobs, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    """A finished generation: the completion (without the prompt) and its statistics.

    ``logprobs``: with ``logprobs=True``, one :class:`PositionLogprobs` per token of
    ``token_ids`` (the target's processed distribution at that position), else ``()``.
    """

    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats
    logprobs: tuple[PositionLogprobs, ...] = ()

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


# --------------------------------------------------------------------------- channels


def _read_pem(value: bytes | str | os.PathLike[str] | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as fh:
        return fh.read()


@dataclass
class _Config:
    address: str
    timeout: float | None
    retries: int
    rate_limit_retries: int
    backoff: float
    max_backoff: float
    metadata: tuple[tuple[str, str], ...]
    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, address: str, **kw: Any) -> _Config:
        if kw["retries"] < 0 or kw["rate_limit_retries"] < 0 or kw["backoff"] < 0:
            raise ValueError("retries, rate_limit_retries and backoff must be >= 0")
        token = kw.pop("token")
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        pems = [_read_pem(kw.pop(k)) for k in ("root_certificates", "private_key", "certificate_chain")]
        tls = kw.pop("tls")
        if tls is None:
            tls = any(p is not None for p in pems)
        if (pems[1] is None) != (pems[2] is None):
            raise ValueError("pass both private_key and certificate_chain (mutual TLS), or neither")
        creds = grpc.ssl_channel_credentials(*pems) if tls else None
        options = [
            ("grpc.max_receive_message_length", kw.pop("max_message_bytes")),
            ("grpc.enable_retries", 0),  # the SDK retries itself, only where that is safe
        ]
        if kw.get("server_name_override"):
            options.append(("grpc.ssl_target_name_override", kw["server_name_override"]))
        kw.pop("server_name_override", None)
        return cls(address=address, metadata=metadata, credentials=creds, options=options, **kw)

    def delay(self, attempt: int, err: errors.SpecServeError) -> float:
        if err.retry_after_s is not None:
            return err.retry_after_s
        # Equal jitter: many clients reconnecting at once do not retry in lockstep.
        return min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)

    def retry_wait(self, err: errors.SpecServeError, tried: dict[str, int], received: bool) -> float | None:
        """Seconds to wait before sending the request again, or None: ``err`` is final. Only before any
        message arrived: UNAVAILABLE up to ``retries`` times (:meth:`delay`), RESOURCE_EXHAUSTED with a
        retry hint of at most :data:`RATE_LIMIT_MAX_WAIT_S` up to ``rate_limit_retries`` times (the hint).
        ``tried`` counts the retries so far by kind."""
        if received:
            return None
        if isinstance(err, errors.Unavailable) and tried.get("unavailable", 0) < self.retries:
            wait = self.delay(tried.get("unavailable", 0), err)
            tried["unavailable"] = tried.get("unavailable", 0) + 1
            return wait
        hint = err.retry_after_s
        if (
            isinstance(err, errors.ResourceExhausted)
            and hint is not None
            and 0 <= hint <= RATE_LIMIT_MAX_WAIT_S
            and tried.get("exhausted", 0) < self.rate_limit_retries
        ):
            tried["exhausted"] = tried.get("exhausted", 0) + 1
            return hint
        return None


class _Collector:
    """Folds response messages into chunks and, at the end, a :class:`GenerateResult`."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.stats: GenerationStats | None = None

    def add(self, response: coordinator_pb2.GenerateResponse) -> StreamChunk | None:
        kind = response.WhichOneof("event")
        if kind == "chunk":
            logprobs = tuple(PositionLogprobs.from_pb(p) for p in response.chunk.logprobs)
            chunk = StreamChunk(tuple(response.chunk.token_ids), response.chunk.text, logprobs)
            self.token_ids.extend(chunk.token_ids)
            self.text.append(chunk.text)
            self.logprobs.extend(logprobs)
            return chunk
        if kind == "stats":
            self.stats = GenerationStats.from_pb(response.stats)
        return None

    def result(self, address: str) -> GenerateResult:
        if self.stats is None:
            raise errors.SpecServeError(f"the stream from {address} ended without its closing statistics")
        return GenerateResult("".join(self.text), tuple(self.token_ids), self.stats, tuple(self.logprobs))


class _StreamBase:
    def __init__(self) -> None:
        self._result: GenerateResult | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerateResult:
        """The whole generation; available once the stream is exhausted."""
        if self._result is None:
            raise RuntimeError("the stream is not finished yet: iterate it to the end first")
        return self._result

    @property
    def stats(self) -> GenerationStats:
        return self.result.stats


# --------------------------------------------------------------------------- blocking client


class TokenStream(_StreamBase, Iterator[StreamChunk]):
    """Iterator of :class:`StreamChunk`; ``.result`` / ``.stats`` once exhausted; ``.cancel()``."""

    def __init__(self, client: Client, request: coordinator_pb2.GenerateRequest) -> None:
        super().__init__()
        self._client = client
        self._call: Any = None
        self._gen = self._run(request)

    def _run(self, request: coordinator_pb2.GenerateRequest) -> Generator[StreamChunk, None, None]:
        cfg, tried = self._client._cfg, dict[str, int]()
        while True:
            collector, received = _Collector(), False
            self._call = self._client._stub.Generate(request, timeout=cfg.timeout, metadata=cfg.metadata)
            try:
                for response in self._call:
                    received = True
                    chunk = collector.add(response)
                    if chunk is not None:
                        yield chunk
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, cfg.address)
                wait = cfg.retry_wait(err, tried, received)
                if wait is not None:
                    time.sleep(wait)
                    continue
                raise err from exc
            finally:
                if not collector.stats:
                    self._call.cancel()
            self._result = collector.result(cfg.address)
            return

    def __next__(self) -> StreamChunk:
        return next(self._gen)

    def cancel(self) -> None:
        """Cancel the request on the server; iterating further raises :class:`~specserve.api.errors.Cancelled`."""
        if self._call is not None and self._result is None:
            self._call.cancel()

    def close(self) -> None:
        self.cancel()
        self._gen.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Client(ClientMethods):
    """Blocking client of a specserve coordinator.

    Args:
        address: ``host:port`` of the coordinator.
        timeout: deadline of each attempt of a call, in seconds (``None``: none).
        retries: extra attempts after UNAVAILABLE before any token arrived.
        rate_limit_retries: extra attempts after RESOURCE_EXHAUSTED with a retry hint (a session limit
            or rate; at most ``RATE_LIMIT_MAX_WAIT_S``, 60 s) before any token arrived, each after the hint.
        backoff: first retry delay in seconds; doubles each retry up to ``max_backoff``.
        token: bearer token, sent as ``authorization: Bearer <token>``.
        tls: use TLS (default: when any PEM below is given; ``True`` alone uses the system roots).
        root_certificates, private_key, certificate_chain: PEM bytes or file paths
            (the CA to trust; a client key and certificate for mutual TLS).
        server_name_override: TLS host name to expect (tests with an IP address).

    Example::

        with Client("127.0.0.1:50051") as client:
            print(client.generate("def add(a, b):", max_new_tokens=16, temperature=0).text)
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 600.0,
        retries: int = 3,
        rate_limit_retries: int = 3,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        private_key: bytes | str | os.PathLike[str] | None = None,
        certificate_chain: bytes | str | os.PathLike[str] | None = None,
        server_name_override: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self._cfg = _Config.build(
            address, timeout=timeout, retries=retries, rate_limit_retries=rate_limit_retries, backoff=backoff,
            max_backoff=max_backoff,
            token=token, tls=tls, root_certificates=root_certificates, private_key=private_key,
            certificate_chain=certificate_chain, server_name_override=server_name_override,
            max_message_bytes=max_message_bytes,
        )  # fmt: skip
        cfg = self._cfg
        if cfg.credentials is not None:
            self._channel = grpc.secure_channel(address, cfg.credentials, options=cfg.options)
        else:
            self._channel = grpc.insecure_channel(address, options=cfg.options)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self._cfg.address

    def _open(self, request: coordinator_pb2.GenerateRequest) -> TokenStream:
        return TokenStream(self, request)

    def _finish(self, stream: TokenStream) -> GenerateResult:
        with stream:
            for _ in stream:
                pass
        return stream.result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------- asyncio client


class AsyncTokenStream(_StreamBase, AsyncIterator[StreamChunk]):
    """Async iterator of :class:`StreamChunk`; ``.result`` / ``.stats`` once exhausted; ``.cancel()``."""

    def __init__(self, client: AsyncClient, request: coordinator_pb2.GenerateRequest) -> None:
        super().__init__()
        self._client = client
        self._call: Any = None
        self._gen = self._run(request)

    async def _run(self, request: coordinator_pb2.GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        cfg, tried = self._client._cfg, dict[str, int]()
        stub = self._client._ensure_stub()
        while True:
            collector, received = _Collector(), False
            self._call = stub.Generate(request, timeout=cfg.timeout, metadata=cfg.metadata)
            try:
                async for response in self._call:
                    received = True
                    chunk = collector.add(response)
                    if chunk is not None:
                        yield chunk
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, cfg.address)
                wait = cfg.retry_wait(err, tried, received)
                if wait is not None:
                    await asyncio.sleep(wait)
                    continue
                raise err from exc
            finally:
                if not collector.stats:
                    self._call.cancel()
            self._result = collector.result(cfg.address)
            return

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    def cancel(self) -> None:
        """Cancel the request on the server."""
        if self._call is not None and self._result is None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await self._gen.aclose()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncClient(AsyncClientMethods):
    """asyncio client of a specserve coordinator; same arguments as :class:`Client`.

    The channel is opened on first use inside the running event loop.

    Example::

        import asyncio
        from specserve import AsyncClient

        async def main():
            async with AsyncClient("127.0.0.1:50051") as client:
                result = await client.generate("def add(a, b):", max_new_tokens=16, temperature=0)
                print(result.text)

        asyncio.run(main())
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        defaults: dict[str, Any] = {
            "timeout": 600.0, "retries": 3, "rate_limit_retries": 3, "backoff": 0.2, "max_backoff": 5.0,
            "token": None,
            "tls": None, "root_certificates": None, "private_key": None, "certificate_chain": None,
            "server_name_override": None, "max_message_bytes": 16 * 1024 * 1024,
        }  # fmt: skip
        unknown = set(kwargs) - set(defaults)
        if unknown:
            raise TypeError(f"unknown AsyncClient arguments: {sorted(unknown)}")
        self._cfg = _Config.build(address, **{**defaults, **kwargs})
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorServiceStub | None = None

    @property
    def address(self) -> str:
        return self._cfg.address

    def _ensure_stub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        if self._stub is None:
            cfg = self._cfg
            if cfg.credentials is not None:
                self._channel = grpc.aio.secure_channel(cfg.address, cfg.credentials, options=cfg.options)
            else:
                self._channel = grpc.aio.insecure_channel(cfg.address, options=cfg.options)
            self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        return self._stub

    def _open(self, request: coordinator_pb2.GenerateRequest) -> AsyncTokenStream:
        return AsyncTokenStream(self, request)

    async def _finish(self, stream: AsyncTokenStream) -> GenerateResult:
        async with stream:
            async for _ in stream:
                pass
        return stream.result

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
