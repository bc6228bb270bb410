"""specserve: distributed speculative decoding that never changes what the model would have said.

The package root is the client SDK and imports only gRPC and protobuf:
``from specserve import Client``. Serving code lives in submodules that need the
``[serve]`` extra (torch, transformers, redis).

Example (with a coordinator running, e.g. ``specserve up``)::

    from specserve import Client

    with Client("127.0.0.1:50051") as client:
        result = client.generate("def fibonacci(n):", max_new_tokens=32, temperature=0)
        print(result.text, result.stats.acceptance_rate)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncTokenStream",
    "ChatMessages",
    "Client",
    "GenerateResult",
    "GenerationParams",
    "GenerationStats",
    "PositionLogprobs",
    "StreamChunk",
    "TokenLogprob",
    "TokenStream",
    "__version__",
]

if TYPE_CHECKING:
    from specserve.client import (
        AsyncClient,
        AsyncTokenStream,
        ChatMessages,
        Client,
        GenerateResult,
        GenerationParams,
        GenerationStats,
        PositionLogprobs,
        StreamChunk,
        TokenLogprob,
        TokenStream,
    )


def __getattr__(name: str) -> Any:
    # Lazy, so that server modules importing ``specserve.<x>`` do not pay for the SDK.
    if name in __all__ and name != "__version__":
        from specserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
