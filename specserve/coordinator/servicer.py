"""The CoordinatorService gRPC servicer: thin (request -> domain -> replies).

Errors are raised as :mod:`specserve.api.errors` classes; the server's
``ErrorInterceptor`` maps them to status codes (INVALID_ARGUMENT for a bad
request, with a message that says what to fix).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from specserve.coordinator.cache_scope import grpc_tenant
from specserve.coordinator.coordinator import Coordinator
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """``Generate``: admit the caller, parse and check the request, run the session, stream its events."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        # Admission first: a refused request does no work (no tokenizing, no constraint compile).
        client = self.coordinator.clients.of_call(context)
        (place,) = self.coordinator.admit(client)
        with place:
            generation = await self.coordinator.parse(request, client=client)
            tenant = grpc_tenant(context, by_token=bool(self.coordinator.settings.auth_tokens))
            async with contextlib.aclosing(self.coordinator.generate(generation, place, tenant=tenant)) as events:
                async for event in events:
                    yield event.to_pb()
