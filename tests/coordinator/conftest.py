"""Fixtures shared by the coordinator tests."""

import pytest_asyncio

from specserve.store import SessionStore


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    """A SessionStore on the shared test Redis, one per module (module event loop)."""
    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()
