"""Async gRPC clients of the draft and target workers: the coordinator's one module that reads and writes the wire.

A round's messages (:mod:`specserve.coordinator.messages`) and a :class:`DraftCall` become protobufs here and
come back as the same domain types.

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
from typing import Any, ClassVar

import grpc

from specserve.api import errors
from specserve.api.params import SamplingParams, SessionBase, Verdict
from specserve.api.status import item_error, worker_error_from_rpc
from specserve.coordinator.messages import Proposal, Verified, VerifyRequest
from specserve.core.features import FeatureBlock
from specserve.core.ranked_tree import CHAIN, TreeBudget
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
    #: The feature a target returns, or a draft's head reads ("": a draft without a head).
    feature: str = ""


@dataclass(frozen=True)
class DraftCall:
    """One session's request for a proposal (sent alone or as an item of a ProposeBatch call)."""

    base: SessionBase
    start_position: int  # ``token_ids`` are the committed tokens from here on
    token_ids: Sequence[int]
    sampling: SamplingParams
    gamma: int
    proposer: int  # a ProposerKind (specserve.api.params.PROPOSER_KINDS)
    draft_top_k: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_confidence: float = 0.0
    stop_tokens_from: int = 0
    prompt_len: int = 0
    cache_scope: bytes = b""
    features: FeatureBlock | None = None  # the target's features the feature head lacks
    features_reset: bool = False  # they replace the head's context instead of continuing it
    tree: TreeBudget = CHAIN  # how far the proposal may branch into the draft's alternatives


@dataclass(frozen=True)
class ProposeBatchReply:
    results: tuple[Proposal | errors.SpecServeError, ...]  # per item: its proposal, or its own error
    draft_ns: int  # the draft's own account of the whole call


@dataclass(frozen=True)
class VerifyReply:
    results: tuple[Verified, ...]  # per item (what the call cost is the batcher's to add)
    verify_ns: int
    forward_ns: int
    positions_processed: int


def _verify_item(request: VerifyRequest) -> target_pb2.VerifyItem:
    proposal = request.proposal
    distributions = proposal.distributions
    if proposal.parents and any(d is None for d in distributions):  # a tree's point masses among drawn tokens
        distributions = tuple(
            _point_mass(t) if d is None else d for t, d in zip(proposal.token_ids, distributions, strict=True)
        )
    item = target_pb2.VerifyItem(
        base=request.base.to_pb(),
        proposal=common_pb2.Proposal(
            token_ids=proposal.token_ids, distributions=distributions, parents=proposal.parents
        ),
        decode_steps=request.decode_steps,
        cache_scope=request.cache_scope,
    )
    if request.top_logprobs is not None:
        item.logprobs.CopyFrom(common_pb2.LogprobsParams(top_logprobs=request.top_logprobs))
    if request.features is not None:
        item.features_from = request.features.start
        item.features_from_uncached = request.features.uncached
        item.features_max_bytes = request.features.max_bytes
    return item


def _point_mass(token: int) -> common_pb2.DraftDistribution:
    return common_pb2.DraftDistribution(sparse=common_pb2.SparseDistribution(token_ids=[token], probs=[1.0]))


def _verified(request: VerifyRequest, pb: target_pb2.VerifyResult) -> Verified:
    if pb.WhichOneof("outcome") == "verdict":
        features = FeatureBlock.from_pb(pb.features) if pb.HasField("features") else None
        return Verified(request, Verdict.from_pb(pb.verdict), None, pb.replayed, features, pb.cached_tokens)
    return Verified(request, error=item_error(pb.error.code, pb.error.message))


def _propose_request(call: DraftCall) -> draft_pb2.ProposeRequest:
    request = draft_pb2.ProposeRequest(
        base=call.base.to_pb(),
        start_position=call.start_position,
        token_ids=call.token_ids,
        sampling=call.sampling.to_pb(),
        gamma=call.gamma,
        proposer=call.proposer,
        draft_top_k=call.draft_top_k,
        seed=call.sampling.seed,
        stop_token_ids=call.stop_token_ids,
        ignore_eos=call.ignore_eos,
        min_confidence=call.min_confidence,
        stop_tokens_from=call.stop_tokens_from,
        prompt_len=call.prompt_len,
        cache_scope=call.cache_scope,
    )
    if call.features is not None:
        request.features.CopyFrom(call.features.to_pb())
        request.features_reset = call.features_reset
    if call.tree.branches:
        request.tree_max_nodes = call.tree.max_nodes
        request.tree_min_path_probability = call.tree.min_path_probability
        request.tree_expand_min_path_probability = call.tree.expand_min_path_probability
    return request


def _proposal(pb: draft_pb2.ProposeResponse) -> Proposal:
    needed = pb.features_needed_from if pb.HasField("features_needed_from") else None
    return Proposal(
        tuple(pb.proposal.token_ids),
        tuple(pb.proposal.distributions),
        parents=tuple(pb.proposal.parents),
        draft_ns=pb.draft_ns,
        prefill_tokens=pb.prefill_tokens,
        features_needed_from=needed,
        expansion_passes=pb.expansion_passes,
    )


class _WorkerClient:
    """A channel to one worker replica; calls carry deadlines and the request id, errors become domain errors."""

    #: The RPC that drops a session on the worker, and its request message.
    _release_rpc: ClassVar[str]
    _release_request: ClassVar[type]

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

    async def release(self, session_id: str) -> bool:
        """Drop the session's cache on the worker; False when the worker did not hold it."""
        try:
            await self._call(self._release_rpc, self._release_request(session_id=session_id))
        except errors.NotFound:
            return False
        return True


class DraftClient(_WorkerClient):
    """One draft replica."""

    _release_rpc = "ReleaseDraftSession"
    _release_request = draft_pb2.ReleaseDraftSessionRequest

    def __init__(self, endpoint: str, settings: CoordinatorSettings) -> None:
        super().__init__(endpoint, settings, draft_pb2_grpc.DraftServiceStub)
        self._propose_timeout = settings.draft_timeout_s

    async def propose_one(self, call: DraftCall, *, timeout_s: float | None = None) -> Proposal:
        """One ``Propose`` call; the draft's refusal is raised."""
        request = _propose_request(call)
        return _proposal(await self._call("Propose", request, timeout_s or self._propose_timeout))

    async def propose_batch(self, calls: Sequence[DraftCall], *, timeout_s: float | None = None) -> ProposeBatchReply:
        """One ``ProposeBatch`` call; a failure of the whole call raises, per-item errors come back in results."""
        request = draft_pb2.ProposeBatchRequest(items=[_propose_request(c) for c in calls])
        reply = await self._call("ProposeBatch", request, timeout_s or self._propose_timeout)
        if len(reply.results) != len(calls):
            raise errors.WorkerError(
                f"{self.endpoint}: ProposeBatch returned {len(reply.results)} results for {len(calls)} items"
            )
        results: list[Proposal | errors.SpecServeError] = [
            _proposal(r.proposal)
            if r.WhichOneof("outcome") == "proposal"
            else item_error(r.error.code, f"{self.endpoint}: {r.error.message}")
            for r in reply.results
        ]
        return ProposeBatchReply(results=tuple(results), draft_ns=reply.draft_ns)

    async def info(self, timeout_s: float | None = None) -> WorkerInfo:
        reply = await self._call("GetDraftInfo", draft_pb2.GetDraftInfoRequest(), timeout_s)
        return WorkerInfo(
            ModelInfo.from_pb(reply.model),
            reply.max_gamma,
            reply.max_batch_size or None,
            proposers=frozenset(int(k) for k in reply.proposers),
            feature=reply.feature,
        )


class TargetClient(_WorkerClient):
    """One target replica."""

    _release_rpc = "ReleaseTargetSession"
    _release_request = target_pb2.ReleaseTargetSessionRequest

    def __init__(self, endpoint: str, settings: CoordinatorSettings) -> None:
        super().__init__(endpoint, settings, target_pb2_grpc.TargetServiceStub)

    async def verify(self, requests: Sequence[VerifyRequest]) -> VerifyReply:
        """One batched Verify call; a failure of the whole call raises, per-item errors come back in results."""
        reply = await self._call("Verify", target_pb2.VerifyRequest(items=[_verify_item(r) for r in requests]))
        if len(reply.results) != len(requests):
            raise errors.WorkerError(
                f"{self.endpoint}: Verify returned {len(reply.results)} results for {len(requests)} items"
            )
        return VerifyReply(
            results=tuple(_verified(q, r) for q, r in zip(requests, reply.results, strict=True)),
            verify_ns=reply.verify_ns,
            forward_ns=reply.forward_ns,
            positions_processed=reply.positions_processed,
        )

    async def info(self, timeout_s: float | None = None) -> WorkerInfo:
        reply = await self._call("GetTargetInfo", target_pb2.GetTargetInfoRequest(), timeout_s)
        return WorkerInfo(
            ModelInfo.from_pb(reply.model),
            reply.max_gamma,
            reply.max_batch_size,
            tuple(reply.verify_curve_ns),
            feature=reply.feature,
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
