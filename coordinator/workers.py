"""Async gRPC clients of the draft and target workers, with deadlines and error translation.

Each call carries a deadline (``settings.draft_timeout_s`` for Propose,
``settings.rpc_timeout_s`` for the rest) and a failed call
becomes one of :mod:`specserve.errors` (:func:`error_from_rpc`), so the round
loop reasons about ``Unavailable`` / ``DeadlineExceeded`` / ``VersionConflict``
and never about ``grpc.RpcError``. Channels use the coordinator's message
limit, keepalive, and TLS (optionally mutual) when ``worker_tls_ca_file`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from specserve import errors
from specserve.config import CoordinatorSettings
from specserve.interceptors import outgoing_metadata
from specserve.models import ModelInfo
from specserve.params import SamplingParams, SessionBase, Verdict
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

#: grpc status -> the domain error it becomes on the coordinator side.
_BY_CODE: dict[grpc.StatusCode, type[errors.SpecServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.ABORTED: errors.VersionConflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
}


class WorkerError(errors.Unavailable):
    """A worker failed in a way that is its bug (INTERNAL, UNKNOWN, ...): the coordinator treats it as down."""


def error_from_rpc(exc: grpc.RpcError, endpoint: str) -> errors.SpecServeError:
    """The domain error for a failed call to ``endpoint``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, WorkerError)
    return cls(f"{endpoint}: {code.name}: {details}")


#: Codes after which the same call may succeed elsewhere or later (worker down or slow).
TRANSIENT = (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted, WorkerError)


def _channel(endpoint: str, settings: CoordinatorSettings) -> grpc.aio.Channel:
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if settings.worker_tls_ca_file is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    ca = settings.worker_tls_ca_file.read_bytes()
    key = settings.worker_tls_key_file.read_bytes() if settings.worker_tls_key_file else None
    cert = settings.worker_tls_cert_file.read_bytes() if settings.worker_tls_cert_file else None
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(endpoint, creds, options=options)


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's model facts and limits."""

    model: ModelInfo
    max_gamma: int
    max_batch_size: int | None = None


@dataclass(frozen=True)
class ProposeResult:
    proposal: common_pb2.Proposal  # passed through to Verify untouched
    draft_ns: int
    prefill_tokens: int


@dataclass(frozen=True)
class ItemResult:
    """One Verify item's outcome: a verdict (maybe replayed) or the error that kept it uncommitted."""

    session_id: str
    verdict: Verdict | None
    replayed: bool
    error: errors.SpecServeError | None


@dataclass(frozen=True)
class VerifyReply:
    results: tuple[ItemResult, ...]
    verify_ns: int
    forward_ns: int
    positions_processed: int


_ITEM_CODES: dict[int, type[errors.SpecServeError]] = {
    grpc.StatusCode.NOT_FOUND.value[0]: errors.NotFound,
    grpc.StatusCode.ABORTED.value[0]: errors.VersionConflict,
    grpc.StatusCode.FAILED_PRECONDITION.value[0]: errors.FailedPrecondition,
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: errors.InvalidArgument,
}


def item_result_from_pb(pb: target_pb2.VerifyResult) -> ItemResult:
    if pb.WhichOneof("outcome") == "verdict":
        return ItemResult(pb.session_id, Verdict.from_pb(pb.verdict), pb.replayed, None)
    cls = _ITEM_CODES.get(pb.error.code, errors.FailedPrecondition)
    return ItemResult(pb.session_id, None, False, cls(pb.error.message))


class _WorkerClient:
    """A channel to one worker replica; calls carry deadlines and the request id, errors become domain errors."""

    def __init__(self, endpoint: str, settings: CoordinatorSettings, stub_class: type) -> None:
        self.endpoint = endpoint
        self._timeout = settings.rpc_timeout_s
        self._channel = _channel(endpoint, settings)
        self._stub = stub_class(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        # Looked up at call time: a test may swap the stub to inject faults.
        method = getattr(self._stub, rpc)
        try:
            return await method(request, timeout=timeout_s or self._timeout, metadata=outgoing_metadata())
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.endpoint) from exc

    async def _release(self, rpc: str, request: Any) -> bool:
        """Drop a session on the worker; False when the worker did not hold it."""
        try:
            await self._call(rpc, request)
        except errors.NotFound:
            return False
        return True


class DraftClient(_WorkerClient):
    """One draft replica."""

    def __init__(self, endpoint: str, settings: CoordinatorSettings) -> None:
        super().__init__(endpoint, settings, draft_pb2_grpc.DraftServiceStub)
        self._propose_timeout = settings.draft_timeout_s

    async def propose(
        self,
        base: SessionBase,
        *,
        start_position: int,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        gamma: int,
        proposer: int,
        draft_top_k: int,
        timeout_s: float | None = None,
    ) -> ProposeResult:
        request = draft_pb2.ProposeRequest(
            base=base.to_pb(),
            start_position=start_position,
            token_ids=token_ids,
            sampling=sampling.to_pb(),
            gamma=gamma,
            proposer=proposer,
            draft_top_k=draft_top_k,
            seed=sampling.seed,
        )
        reply = await self._call("Propose", request, timeout_s or self._propose_timeout)
        return ProposeResult(reply.proposal, reply.draft_ns, reply.prefill_tokens)

    async def release(self, session_id: str) -> bool:
        """Drop the session's draft cache; False when the draft did not hold it."""
        return await self._release(
            "ReleaseDraftSession", draft_pb2.ReleaseDraftSessionRequest(session_id=session_id)
        )

    async def info(self, timeout_s: float | None = None) -> WorkerInfo:
        reply = await self._call("GetDraftInfo", draft_pb2.GetDraftInfoRequest(), timeout_s)
        return WorkerInfo(ModelInfo.from_pb(reply.model), reply.max_gamma)


class TargetClient(_WorkerClient):
    """One target replica."""

    def __init__(self, endpoint: str, settings: CoordinatorSettings) -> None:
        super().__init__(endpoint, settings, target_pb2_grpc.TargetServiceStub)

    async def verify(self, items: Sequence[target_pb2.VerifyItem]) -> VerifyReply:
        """One batched Verify call; a failure of the whole call raises, per-item errors come back in results."""
        reply = await self._call("Verify", target_pb2.VerifyRequest(items=items))
        if len(reply.results) != len(items):
            raise WorkerError(
                f"{self.endpoint}: Verify returned {len(reply.results)} results for {len(items)} items"
            )
        return VerifyReply(
            results=tuple(item_result_from_pb(r) for r in reply.results),
            verify_ns=reply.verify_ns,
            forward_ns=reply.forward_ns,
            positions_processed=reply.positions_processed,
        )

    async def release(self, session_id: str) -> bool:
        """Drop the session's target cache; False when the target did not hold it."""
        return await self._release(
            "ReleaseTargetSession", target_pb2.ReleaseTargetSessionRequest(session_id=session_id)
        )

    async def info(self, timeout_s: float | None = None) -> WorkerInfo:
        reply = await self._call("GetTargetInfo", target_pb2.GetTargetInfoRequest(), timeout_s)
        return WorkerInfo(ModelInfo.from_pb(reply.model), reply.max_gamma, reply.max_batch_size)
