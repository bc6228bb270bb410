"""Shared fixtures. ``tests/`` is put on ``sys.path`` so test modules can
``import tiny_models`` and ``import system_fixtures``; the private Redis is
:class:`specserve.launch.redis_server.RedisServer`."""

import os
import sys
from pathlib import Path

import pytest

# Tiny test models gain nothing from intra-op threads, and on a small shared
# machine oversubscribed OpenMP threads slow every process down. Subprocesses
# (servers started by tests) inherit the limit.
os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the SDK-only environment
    pass

sys.path.insert(0, str(Path(__file__).resolve().parent))

from specserve.launch.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server on a free 127.0.0.1 port for the whole test session."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
async def store(redis_url):
    """A SessionStore on the shared test Redis (session ids in tests must be unique)."""
    from specserve.runtime.store import SessionStore

    s = SessionStore.from_url(redis_url, ttl_s=600)
    yield s
    await s.close()
