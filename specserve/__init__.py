"""specserve: distributed speculative decoding that never changes what the model would have said.

The package root is the client SDK and imports only gRPC and protobuf:
``from specserve import Client``. Serving code lives in submodules that need the
``[serve]`` extra (torch, transformers, redis).
"""

from __future__ import annotations

__version__ = "0.1.0"
