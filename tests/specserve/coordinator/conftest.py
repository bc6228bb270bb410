"""Fixtures shared by the coordinator tests."""

import pytest
import pytest_asyncio
import system_fixtures as sf

from specserve.runtime.store import SessionStore


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    """A SessionStore on the shared test Redis, one per module (module event loop)."""
    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny float32 pair (``system_fixtures.tiny_pair``); a module that needs another defines its own."""
    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    """The whole system on loopback (``system_fixtures.local_stack``) with default settings, one per module;
    a module that needs other settings defines its own."""
    async with sf.local_stack(pair, redis_server.url) as s:
        yield s
