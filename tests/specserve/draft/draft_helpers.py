"""Helpers of the draft-service tests (importable by basename: pytest puts this folder on sys.path)."""

from __future__ import annotations

from specserve.runtime.config import DraftSettings

#: The max_gamma of every test draft server.
MAX_GAMMA = 8


def draft_settings(**overrides) -> DraftSettings:
    """Settings of a test draft server: 127.0.0.1, a free port, no warm-up."""
    fields = {"host": "127.0.0.1", "port": 0, "max_gamma": MAX_GAMMA, "warmup": False, **overrides}
    return DraftSettings(**fields)
