"""The CoordinatorService gRPC servicer: thin (request -> domain -> replies).

Errors are raised as :mod:`specserve.api.errors` classes; the server's
``ErrorInterceptor`` maps them to status codes (INVALID_ARGUMENT for a bad
request, with a message that says what to fix).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from coordinator.coordinator import Coordinator
from specserve.runtime.interceptors import client_identity
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """``Generate``: parse and check the request, run the session, stream its events."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        client = client_identity(context, by_token=bool(self.coordinator.settings.auth_tokens))
        generation = await self.coordinator.parse(request, client=client)
        async with contextlib.aclosing(self.coordinator.generate(generation, client=client)) as events:
            async for event in events:
                yield event.to_pb()
