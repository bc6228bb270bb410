"""The CoordinatorService gRPC servicer: thin (request -> domain -> replies), and the coordinator's front end's
edge with the wire: a ``GenerateRequest`` becomes :class:`~specserve.api.params.GenerationParams` and a
:class:`~specserve.coordinator.requests.Prompt`, and the coordinator's events
(:class:`~specserve.coordinator.coordinator.Chunk`, :class:`~specserve.coordinator.coordinator.Finished`)
become ``GenerateResponse`` messages, here only.

Errors are raised as :mod:`specserve.api.errors` classes; the server's
``ErrorInterceptor`` maps them to status codes (INVALID_ARGUMENT for a bad
request, with a message that says what to fix).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import grpc

from specserve.api.params import PROPOSER_KINDS, GenerationParams
from specserve.api.stats import FINISH_REASON_NAMES, GenerationStats
from specserve.coordinator.cache_scope import grpc_tenant
from specserve.coordinator.chat import Conversation
from specserve.coordinator.coordinator import Chunk, Coordinator, Finished
from specserve.coordinator.requests import Prompt
from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


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
            generation = await self.coordinator.parse(*request_from_pb(request), client=client)
            tenant = grpc_tenant(context, by_token=bool(self.coordinator.settings.auth_tokens))
            async with contextlib.aclosing(self.coordinator.generate(generation, place, tenant=tenant)) as events:
                async for event in events:
                    yield response_pb(event)


def request_from_pb(pb: coordinator_pb2.GenerateRequest) -> tuple[GenerationParams, Prompt]:
    """A ``GenerateRequest``'s settings, checked where they need no server limit, and its prompt as sent."""
    params = GenerationParams.from_pb(pb)
    which = pb.WhichOneof("prompt")
    if which == "text":
        return params, Prompt(text=pb.text)
    if which == "tokens":
        return params, Prompt(token_ids=tuple(pb.tokens.token_ids))
    if which == "chat":
        chat = pb.chat
        return params, Prompt(
            chat=Conversation(
                messages=tuple((m.role, m.content) for m in chat.messages),
                omit_generation_prompt=chat.omit_generation_prompt,
                continue_final_message=chat.continue_final_message,
                template_kwargs_json=chat.template_kwargs_json,
            )
        )
    return params, Prompt()


def response_pb(event: Chunk | Finished) -> coordinator_pb2.GenerateResponse:
    """An event of :meth:`Coordinator.generate` on the wire."""
    if isinstance(event, Finished):
        return coordinator_pb2.GenerateResponse(stats=stats_pb(event.stats))
    return coordinator_pb2.GenerateResponse(
        chunk=coordinator_pb2.TokenChunk(
            token_ids=event.token_ids, text=event.text, logprobs=[p.to_pb() for p in event.logprobs]
        )
    )


#: The SDK's name of each ``FinishReason`` -> its value (``FINISH_REASON_NAMES`` inverted).
_FINISH_REASON_VALUES: dict[str, int] = {name: value for value, name in FINISH_REASON_NAMES.items()}


def stats_pb(stats: GenerationStats) -> coordinator_pb2.GenerationStats:
    """The closing statistics on the wire: every field by its name, ``sources`` a ``SourceStats`` per row,
    ``finish_reason`` and ``proposer`` the enum values of their names (a finish reason without a name is its
    value's digits, as ``GenerationStats.from_pb`` writes it; a proposer "" is UNSPECIFIED)."""
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "sources"}
    fields["finish_reason"] = int(_FINISH_REASON_VALUES.get(stats.finish_reason, stats.finish_reason))
    fields["proposer"] = PROPOSER_KINDS.get(stats.proposer, common_pb2.PROPOSER_KIND_UNSPECIFIED)
    sources = [coordinator_pb2.SourceStats(**dataclasses.asdict(row)) for row in stats.sources]
    return coordinator_pb2.GenerationStats(**fields, sources=sources)
