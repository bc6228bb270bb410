"""The DraftService gRPC servicer: wire message -> domain object -> one domain call -> reply.

No tensor maths here (STYLE.md 5): :class:`~draft_service.messages.ProposeCall`
checks and converts a request, :class:`~draft_service.engine.DraftEngine` does
the work on the servicer's single model thread, :class:`~draft_service.messages.ProposeResult`
converts back. Domain errors propagate to :class:`specserve.server.ErrorInterceptor`.
"""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor

import grpc

from draft_service.engine import DraftEngine
from draft_service.messages import ProposeCall, ProposeResult
from specserve import metrics
from specserve.kvcache import SessionCacheStore
from specserve.models import ModelInfo
from specserve.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Hosts one :class:`DraftEngine`; every model call runs on one worker thread, in arrival order."""

    def __init__(
        self, engine: DraftEngine, info: ModelInfo, *, max_gamma: int, caches: SessionCacheStore | None = None
    ) -> None:
        self.engine = engine
        self.info = info
        self.max_gamma = max_gamma
        self.caches = caches
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")

    async def _run(self, fn, *args):
        # The caller's contextvars (request_id bound by the interceptor) go along, for the logs.
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, fn, *args)

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        call = ProposeCall.from_pb(request, vocab_size=self.info.vocab_size, max_gamma=self.max_gamma)
        with metrics.DRAFT_QUEUE_DEPTH.track_inprogress(), metrics.DRAFT_SECONDS.time():
            result = await self._run(self._propose, call)
        return result.to_pb()

    def _propose(self, call: ProposeCall) -> ProposeResult:
        """On the model thread: the domain call, then the cache gauges (the store is not thread-safe)."""
        result = self.engine.propose(call)
        self._update_gauges()
        return result

    def _release(self, session_id: str) -> None:
        """On the model thread: drop the session, then the cache gauges."""
        try:
            self.engine.release(session_id)
        finally:
            self._update_gauges()

    def _update_gauges(self) -> None:
        if self.caches is not None:
            metrics.CACHED_SESSIONS.labels(role="draft").set(len(self.caches))
            metrics.KV_CACHE_BYTES.labels(role="draft").set(self.caches.total_bytes)

    async def ReleaseDraftSession(
        self, request: draft_pb2.ReleaseDraftSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ReleaseDraftSessionResponse:
        await self._run(self._release, request.session_id)
        return draft_pb2.ReleaseDraftSessionResponse()

    async def GetDraftInfo(
        self, request: draft_pb2.GetDraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.GetDraftInfoResponse:
        return draft_pb2.GetDraftInfoResponse(model=self.info.to_pb(), max_gamma=self.max_gamma)

    async def idle(self) -> None:
        """Wait until every model call submitted so far has finished."""
        await self._run(lambda: None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
