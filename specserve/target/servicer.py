"""The TargetService gRPC servicer: wire message -> domain object -> one domain call -> reply.

No tensor maths here (docs/design.md, "Conventions": thin servicers):
:class:`~specserve.target.messages.VerifyBatch` checks and converts a request, :class:`~specserve.target.verifier.Verifier` does
the work, :class:`~specserve.target.messages.BatchResult` converts back. Domain
errors propagate to :class:`specserve.runtime.server.ErrorInterceptor`, which maps them
to status codes.
"""

from __future__ import annotations

import grpc

from specserve.engine.models import LoadedModel
from specserve.runtime import metrics
from specserve.target.messages import VerifyBatch
from specserve.target.verifier import Verifier
from specserve.v1 import target_pb2, target_pb2_grpc


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Hosts one :class:`Verifier`; limits come from the server's settings."""

    def __init__(
        self, verifier: Verifier, model: LoadedModel, *, max_gamma: int, max_batch_size: int
    ) -> None:
        self.verifier = verifier
        self.model = model
        self.max_gamma = max_gamma
        self.max_batch_size = max_batch_size

    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        batch = VerifyBatch.from_pb(
            request,
            vocab_size=self.model.vocab_size,
            max_gamma=self.max_gamma,
            max_batch_size=self.max_batch_size,
        )
        metrics.TARGET_BATCH_OCCUPANCY.set(len(batch.items) / self.max_batch_size)
        with metrics.TARGET_INFLIGHT.track_inprogress():
            result = await self.verifier.verify(batch)
        return result.to_pb()

    async def ReleaseTargetSession(
        self, request: target_pb2.ReleaseTargetSessionRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ReleaseTargetSessionResponse:
        await self.verifier.release(request.session_id)
        return target_pb2.ReleaseTargetSessionResponse()

    async def GetTargetInfo(
        self, request: target_pb2.GetTargetInfoRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.GetTargetInfoResponse:
        return target_pb2.GetTargetInfoResponse(
            model=self.model.to_pb(),
            max_gamma=self.max_gamma,
            max_batch_size=self.max_batch_size,
            verify_curve_ns=self.verifier.verify_curve_ns,
        )
