"""The client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for a specserve coordinator.

Imports only grpcio, protobuf and the standard library, so a client needs
neither torch nor transformers (``pip install specserve``)::

    from specserve import Client

    with Client("127.0.0.1:50051") as client:
        result = client.generate("def fibonacci(n):", max_new_tokens=48, temperature=0)
        print(result.text)
        print(result.stats.rounds, result.stats.acceptance_rate)

        stream = client.stream("import os\\n", max_new_tokens=32)
        for chunk in stream:                 # StreamChunk(token_ids, text), as tokens commit
            print(chunk.text, end="", flush=True)
        print(stream.result.stats)           # the whole GenerateResult once the stream is exhausted
        # Chat: the server applies the target's chat template (the model must have one).
        messages = [{"role": "user", "content": "What is a hash table?"}]
        reply = client.chat(messages, max_new_tokens=64, temperature=0)
        messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Shorter?"}]
        for chunk in client.stream_chat(messages, max_new_tokens=32):
            print(chunk.text, end="", flush=True)
        # Log probabilities: per token, from the target's processed distribution, with alternatives.
        result = client.generate("def add(a, b):", max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
        for entry in result.logprobs:        # PositionLogprobs(token_id, logprob, top_logprobs)
            print(entry.token_id, entry.logprob, [(t.token_id, t.logprob) for t in entry.top_logprobs])
        # Predicted Outputs: the completion is expected to repeat most of a text (a file being
        # edited); the server drafts from it and verifies every token, so the output is unchanged.
        edited = client.generate("def add(a, b):", max_new_tokens=16, temperature=0, prediction=result.text)
        print(edited.stats.accepted_prediction_tokens, edited.stats.rejected_prediction_tokens)

The asyncio client is the same with ``async``::

    async with AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate("def main():", max_new_tokens=32)
        async with client.stream("class Point:", max_new_tokens=32) as stream:
            async for chunk in stream:
                print(chunk.text, end="")
        print(stream.result.stats.tokens_per_s)

Streams. ``stream(...)`` returns a :class:`TokenStream` (or :class:`AsyncTokenStream`):
iterate it for :class:`StreamChunk` objects; after the last one its ``.result``
(a :class:`GenerateResult`) and ``.stats`` are set. Leaving its ``with`` block
early, or calling ``.cancel()``, cancels the request on the server.

Errors. Every failure is a :class:`specserve.api.errors.SpecServeError` subclass chosen
by the gRPC status code (:data:`ERRORS_BY_CODE`, from :mod:`specserve.api.status`; a
more specific class when the server names one in the ``specserve-error`` trailing metadata), carrying the
server's message and raised ``from`` the ``grpc.RpcError``. The keyword arguments of
``generate``, ``stream``, ``chat`` and ``stream_chat`` are the fields of
:class:`~specserve.api.params.GenerationParams` (one definition; the methods are generated
from it), checked when the call builds them: a bad value (an unknown proposer, a negative
gamma, a temperature below 0) raises :class:`~specserve.api.errors.InvalidArgument` before
any call; the server's own limits (``max_new_tokens``, ``gamma``, prompt length) are checked
by the server.

Retries. A call that fails with UNAVAILABLE *before any message arrived* is
retried up to ``retries`` times with exponential backoff (``backoff`` seconds,
doubling, capped at ``max_backoff``, times a random factor in [0.5, 1]; a
server's retry-after hint wins). One that fails with RESOURCE_EXHAUSTED and a retry hint (a
session limit or the per-client rate of new sessions; the hint is the server's real wait, never 0)
is retried after the hint, up to ``rate_limit_retries`` times (3; a hint over 60 s is raised at
once); after that the :class:`~specserve.api.errors.ResourceExhausted` is raised, with the hint as
``retry_after_s``. Once a
token has arrived a request is never re-sent, so output is never duplicated.
``timeout`` is the deadline of each attempt.
"""

from specserve.api.params import GenerationParams, PositionLogprobs, TokenLogprob
from specserve.api.stats import GenerationStats, SourceStats
from specserve.api.status import ERROR_CLASS_KEY, ERRORS_BY_CODE, error_from_rpc
from specserve.client._client import (
    AsyncClient,
    AsyncTokenStream,
    Client,
    GenerateResult,
    StreamChunk,
    TokenStream,
)
from specserve.client._request import ChatMessages, build_request

__all__ = [
    "ERRORS_BY_CODE",
    "ERROR_CLASS_KEY",
    "AsyncClient",
    "AsyncTokenStream",
    "ChatMessages",
    "Client",
    "GenerateResult",
    "GenerationParams",
    "GenerationStats",
    "PositionLogprobs",
    "SourceStats",
    "StreamChunk",
    "TokenLogprob",
    "TokenStream",
    "build_request",
    "error_from_rpc",
]
