"""Shared fixtures and the two test tiers. ``tests/`` is put on ``sys.path`` so test modules can
``import tiny_models`` and ``import system_fixtures``; the private Redis is
:class:`specserve.launch.redis_server.RedisServer`.

Every test is in exactly one tier (README.md, the test commands; ``tests/tiers.py``):

* ``system``: it starts a server, a process or Redis, or loads a real model from disk or fetches one.
  A test that uses one of ``tiers.SYSTEM_FIXTURES`` (directly or through another fixture) is marked
  ``system`` here; any other system test says so itself (``pytestmark = pytest.mark.system``).
* ``unit``: in-process, and says so itself (``pytestmark = pytest.mark.unit``, or the mark on the test).
  ``tiers.UnitGuard`` fails a unit test that reaches outside the process while its fixtures are set up
  or while it runs.

``tests/test_tiers.py`` fails when a collected test has no tier or both.
"""

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

from tiers import SYSTEM_FIXTURES, TIER_PROBLEMS, TIERS, UnitGuard

from specserve.launch.redis_server import RedisServer

_GUARD = UnitGuard()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects, so the marks added here select
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = {}
    for item in items:
        uses_system = SYSTEM_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses_system and not item.get_closest_marker("system"):
            item.add_marker(pytest.mark.system)
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            problems[item.nodeid] = tiers
    config.stash[TIER_PROBLEMS] = problems


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _guarded(item, "its fixtures' setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guarded(item, "the test"))


def _guarded(item: pytest.Item, phase: str):
    """Run a phase of ``item`` under the unit guard when it is a unit test (a hook wrapper's body)."""
    if not item.get_closest_marker("unit") or item.get_closest_marker("system"):
        return (yield)
    _GUARD.start()
    try:
        result = yield
    finally:
        violations = _GUARD.stop()
    if violations:
        pytest.fail(
            f"a unit test stays in this process, but {phase} {'; '.join(dict.fromkeys(violations))}: "
            "mark it system (tests/conftest.py)",
            pytrace=False,
        )
    return result


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
