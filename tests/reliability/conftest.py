"""Fixtures of the reliability tests.

``role_launcher`` (session): a :class:`~reliability_helpers.RoleLauncher` that forks
``specserve serve ROLE`` processes from one pre-imported process. When the collected
tests include ``test_kill.py`` (and ``SPECSERVE_TEST_FORK_ROLES`` is not ``0``) it is started right after collection, so that its
torch/transformers import runs while the earlier modules' tests do; it is closed at the
end of the session (the role processes themselves are stopped by the tests' fixtures).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio
from reliability_helpers import RoleLauncher, fork_roles

from specserve.runtime.store import SessionStore

_LAUNCHER = pytest.StashKey[RoleLauncher]()
_LOG_DIR = pytest.StashKey[Path]()


def _start(config: pytest.Config) -> RoleLauncher:
    if _LAUNCHER not in config.stash:
        log_dir = Path(tempfile.mkdtemp(prefix="specserve-role-logs-"))
        config.stash[_LOG_DIR] = log_dir
        config.stash[_LAUNCHER] = RoleLauncher(log_dir)
    return config.stash[_LAUNCHER]


@pytest.hookimpl(trylast=True)  # after ``-m`` / ``-k`` deselected: ``pytest -m unit`` starts no launcher
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items) -> None:
    if fork_roles() and any(item.path.name == "test_kill.py" for item in items):
        _start(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    launcher = config.stash.get(_LAUNCHER, None)
    if launcher is not None:
        launcher.close()
        shutil.rmtree(config.stash[_LOG_DIR], ignore_errors=True)


@pytest.fixture(scope="session")
def role_launcher(request) -> RoleLauncher:
    return _start(request.config)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    """A :class:`SessionStore` on the session's Redis, for the module's checks of what was committed."""
    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()
