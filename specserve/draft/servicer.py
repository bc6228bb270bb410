"""The DraftService gRPC servicer: wire message -> domain object -> one domain call -> reply.

No tensor maths here (docs/design.md, "Conventions": thin servicers):
:class:`~specserve.draft.messages.ProposeCall` / :class:`~specserve.draft.messages.ProposeBatchCall`
check and convert a request, :class:`~specserve.draft.engine.DraftEngine` does
the work (model work batched on its model thread),
:class:`~specserve.draft.messages.ProposeResult` / :class:`~specserve.draft.messages.ProposeBatchResult`
convert back. Domain errors propagate to :class:`specserve.runtime.server.ErrorInterceptor`.
"""

from __future__ import annotations

import time

import grpc

from specserve.draft.engine import DraftEngine
from specserve.draft.messages import ProposeBatchCall, ProposeBatchResult, ProposeCall
from specserve.engine.models import ModelInfo
from specserve.runtime import metrics
from specserve.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Hosts one :class:`DraftEngine` (whose model thread drafts what is queued, a batch at a time)."""

    def __init__(self, engine: DraftEngine, info: ModelInfo, *, max_gamma: int, max_tokens: int) -> None:
        self.engine = engine
        self.info = info
        self.max_gamma = max_gamma
        self.max_tokens = max_tokens  # longest committed history a Propose may carry

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        call = ProposeCall.from_pb(
            request, vocab_size=self.info.vocab_size, max_gamma=self.max_gamma, max_tokens=self.max_tokens
        )
        with metrics.DRAFT_SECONDS.time():
            result = await self.engine.propose(call)
        return result.to_pb()

    async def ProposeBatch(
        self, request: draft_pb2.ProposeBatchRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeBatchResponse:
        batch = ProposeBatchCall.from_pb(
            request,
            vocab_size=self.info.vocab_size,
            max_gamma=self.max_gamma,
            max_batch_size=self.engine.max_batch_size,
            max_tokens=self.max_tokens,
        )
        start = time.perf_counter_ns()
        with metrics.DRAFT_SECONDS.time():
            drafted = await self.engine.propose_batch(batch.calls)
        return ProposeBatchResult.merge(batch, drafted, time.perf_counter_ns() - start).to_pb()

    async def ReleaseDraftSession(
        self, request: draft_pb2.ReleaseDraftSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ReleaseDraftSessionResponse:
        await self.engine.release(request.session_id)
        return draft_pb2.ReleaseDraftSessionResponse()

    async def GetDraftInfo(
        self, request: draft_pb2.GetDraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.GetDraftInfoResponse:
        return draft_pb2.GetDraftInfoResponse(
            model=self.info.to_pb(),
            max_gamma=self.max_gamma,
            max_batch_size=self.engine.max_batch_size,
            proposers=sorted(self.engine.proposers),
        )
