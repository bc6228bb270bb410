"""Async gRPC clients of the draft and target workers, with deadlines and error translation.

Each call carries a deadline (``settings.draft_timeout_s`` for Propose,
``settings.rpc_timeout_s`` for the rest) and a failed call becomes one of
:mod:`specserve.api.errors` (:func:`specserve.api.status.worker_error_from_rpc`; a
replica's bug is a :class:`~specserve.api.errors.WorkerError`), so the pool reasons
about ``Unavailable`` / ``DeadlineExceeded`` / ``VersionConflict`` and never
about ``grpc.RpcError``. Channels use the coordinator's message
limit, keepalive, and TLS (optionally mutual) when ``worker_tls_ca_file`` is set;
every call carries the shared ``worker_token`` when one is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from specserve.api import errors
from specserve.api.params import SamplingParams, SessionBase, Verdict
from specserve.api.status import item_error, worker_error_from_rpc
from specserve.core.features import FeatureBlock
from specserve.engine.models import ModelInfo
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.interceptors import outgoing_metadata
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


def _channel(endpoint: str, settings: CoordinatorSettings) -> grpc.aio.Channel:
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.ping_timeout_ms", 10_000),  # the keepalive ping's ack (grpc's default: 60 s)
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
    #: A target's measured verify pass for 1, 2, ... positions (ns); empty: not measured (or a draft).
    verify_curve_ns: tuple[int, ...] = ()
    #: The proposers a draft serves (``ProposerKind`` values; empty for a target).
    proposers: frozenset[int] = frozenset()


@dataclass(frozen=True)
class ProposeReply:
    """A draft's answer: the proposal (passed through to Verify undecoded) and what it cost."""

    proposal: common_pb2.Proposal
    draft_ns: int  # the draft's own account of the call
    prefill_tokens: int  # committed tokens it fed to catch up before drafting
    queue_ns: int = 0  # waiting in the coordinator for its ProposeBatch call to leave
    #: The feature head lacks the target's features from this position on (nothing drafted); None: none lacking.
    features_needed_from: int | None = None


@dataclass(frozen=True)
class ProposeItemReply:
    """One ProposeBatch item's outcome: a proposal, or the error that kept it from being drafted."""

    reply: ProposeReply | None
    error: errors.SpecServeError | None


@dataclass(frozen=True)
class ProposeBatchReply:
    results: tuple[ProposeItemReply, ...]
    draft_ns: int  # the draft's own account of the whole call


@dataclass(frozen=True)
class ItemReply:
    """One Verify item's outcome: a verdict (maybe replayed) or the error that kept it uncommitted."""

    session_id: str
    verdict: Verdict | None
    replayed: bool
    error: errors.SpecServeError | None
    #: The target's features the item asked for (``VerifyItem.features_from``), undecoded; None: none sent.
    features: FeatureBlock | None = None
    #: Committed tokens the target took from its prefix cache in this call (``VerifyResult.cached_tokens``).
    cached_tokens: int = 0


@dataclass(frozen=True)
class VerifyReply:
    results: tuple[ItemReply, ...]
    verify_ns: int
    forward_ns: int
    positions_processed: int


def item_reply_from_pb(pb: target_pb2.VerifyResult) -> ItemReply:
    if pb.WhichOneof("outcome") == "verdict":
        features = FeatureBlock.from_pb(pb.features) if pb.HasField("features") else None
        return ItemReply(
            pb.session_id, Verdict.from_pb(pb.verdict), pb.replayed, None, features, pb.cached_tokens
        )
    return ItemReply(pb.session_id, None, False, item_error(pb.error.code, pb.error.message))


class _WorkerClient:
    """A channel to one worker replica; calls carry deadlines and the request id, errors become domain errors."""

    def __init__(self, endpoint: str, settings: CoordinatorSettings, stub_class: type) -> None:
        self.endpoint = endpoint
        self._timeout = settings.rpc_timeout_s
        self._channel = _channel(endpoint, settings)
        #: The generated stub every call goes through, looked up at call time: a test may wrap or replace it
        #: (to inject a fault or perturb a request) without reaching inside the client.
        self.stub = stub_class(self._channel)
        token = settings.worker_token
        self._auth = () if token is None else (("authorization", f"Bearer {token.get_secret_value()}"),)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        method = getattr(self.stub, rpc)
        try:
            return await method(
                request, timeout=timeout_s or self._timeout, metadata=outgoing_metadata(self._auth)
            )
        except grpc.RpcError as exc:
            raise worker_error_from_rpc(exc, self.endpoint) from exc

    async def _release(self, rpc: str, request: Any) -> bool:
        """Drop a session on the worker; False when the worker did not hold it."""
        try:
            await self._call(rpc, request)
        except errors.NotFound:
            return False
        return True


def propose_request(
    base: SessionBase,
    *,
    start_position: int,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    gamma: int,
    proposer: int,
    draft_top_k: int,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    min_confidence: float = 0.0,
    stop_tokens_from: int = 0,
    prompt_len: int = 0,
    cache_scope: bytes = b"",
) -> draft_pb2.ProposeRequest:
    """The wire request for one session's proposal (sent alone or as an item of a ProposeBatch)."""
    return draft_pb2.ProposeRequest(
        base=base.to_pb(),
        start_position=start_position,
        token_ids=token_ids,
        sampling=sampling.to_pb(),
        gamma=gamma,
        proposer=proposer,
        draft_top_k=draft_top_k,
        seed=sampling.seed,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        min_confidence=min_confidence,
        stop_tokens_from=stop_tokens_from,
        prompt_len=prompt_len,
        cache_scope=cache_scope,
    )


def _propose_reply(pb: draft_pb2.ProposeResponse) -> ProposeReply:
    needed = pb.features_needed_from if pb.HasField("features_needed_from") else None
    return ProposeReply(pb.proposal, pb.draft_ns, pb.prefill_tokens, features_needed_from=needed)


class DraftClient(_WorkerClient):
    """One draft replica."""

    def __init__(self, endpoint: str, settings: CoordinatorSettings) -> None:
        super().__init__(endpoint, settings, draft_pb2_grpc.DraftServiceStub)
        self._propose_timeout = settings.draft_timeout_s

    async def propose_one(
        self, request: draft_pb2.ProposeRequest, *, timeout_s: float | None = None
    ) -> ProposeReply:
        """One ``Propose`` call; the draft's refusal is raised."""
        return _propose_reply(await self._call("Propose", request, timeout_s or self._propose_timeout))

    async def propose_batch(
        self, requests: Sequence[draft_pb2.ProposeRequest], *, timeout_s: float | None = None
    ) -> ProposeBatchReply:
        """One ``ProposeBatch`` call; a failure of the whole call raises, per-item errors come back in results."""
        reply = await self._call(
            "ProposeBatch", draft_pb2.ProposeBatchRequest(items=requests), timeout_s or self._propose_timeout
        )
        if len(reply.results) != len(requests):
            raise errors.WorkerError(
                f"{self.endpoint}: ProposeBatch returned {len(reply.results)} results for {len(requests)} items"
            )
        results = []
        for r in reply.results:
            if r.WhichOneof("outcome") == "proposal":
                results.append(ProposeItemReply(_propose_reply(r.proposal), None))
            else:
                results.append(ProposeItemReply(None, item_error(r.error.code, f"{self.endpoint}: {r.error.message}")))
        return ProposeBatchReply(results=tuple(results), draft_ns=reply.draft_ns)

    async def release(self, session_id: str) -> bool:
        """Drop the session's draft cache; False when the draft did not hold it."""
        return await self._release(
            "ReleaseDraftSession", draft_pb2.ReleaseDraftSessionRequest(session_id=session_id)
        )

    async def info(self, timeout_s: float | None = None) -> WorkerInfo:
        reply = await self._call("GetDraftInfo", draft_pb2.GetDraftInfoRequest(), timeout_s)
        return WorkerInfo(
            ModelInfo.from_pb(reply.model),
            reply.max_gamma,
            reply.max_batch_size or None,
            proposers=frozenset(int(k) for k in reply.proposers),
        )


class TargetClient(_WorkerClient):
    """One target replica."""

    def __init__(self, endpoint: str, settings: CoordinatorSettings) -> None:
        super().__init__(endpoint, settings, target_pb2_grpc.TargetServiceStub)

    async def verify(self, items: Sequence[target_pb2.VerifyItem]) -> VerifyReply:
        """One batched Verify call; a failure of the whole call raises, per-item errors come back in results."""
        reply = await self._call("Verify", target_pb2.VerifyRequest(items=items))
        if len(reply.results) != len(items):
            raise errors.WorkerError(
                f"{self.endpoint}: Verify returned {len(reply.results)} results for {len(items)} items"
            )
        return VerifyReply(
            results=tuple(item_reply_from_pb(r) for r in reply.results),
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
        return WorkerInfo(
            ModelInfo.from_pb(reply.model), reply.max_gamma, reply.max_batch_size, tuple(reply.verify_curve_ns)
        )


@dataclass
class WorkerClients:
    """A client per replica of each tier, by endpoint (channels connect on first use)."""

    drafts: dict[str, DraftClient]
    targets: dict[str, TargetClient]

    @classmethod
    def connect(cls, settings: CoordinatorSettings) -> WorkerClients:
        """Clients of every endpoint in ``settings``; at least one target is required."""
        if not settings.target_endpoints:
            raise ValueError("the coordinator needs at least one target endpoint (target_endpoints)")
        return cls(
            drafts={ep: DraftClient(ep, settings) for ep in settings.draft_endpoints},
            targets={ep: TargetClient(ep, settings) for ep in settings.target_endpoints},
        )

    async def close(self) -> None:
        clients = [*self.drafts.values(), *self.targets.values()]
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
