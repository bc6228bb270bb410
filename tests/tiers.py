"""The two test tiers, ``unit`` and ``system`` (registered in pyproject.toml; tests/conftest.py marks them).

A ``unit`` test runs in this process and touches nothing outside it. :class:`UnitGuard` holds every unit test
to that while its fixtures are set up and while it runs: it fails a unit test that starts a process, opens a
socket to anything (a server, Redis), leaves this process listening on a port it was not listening on
before (a gRPC server, whose sockets Python does not see), or opens a file of a real model (the shipped or
the fetched ones). Such a test is a ``system`` test.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

TIERS = ("unit", "system")
#: Fixtures that start a server, a process or Redis: every test that uses one is a system test.
SYSTEM_FIXTURES = frozenset({"redis_server", "draft_app", "llama_app", "role_launcher", "rendered_text"})
#: The collected tests whose tier is missing or ambiguous (node id -> the tiers found), for tests/test_tiers.py.
TIER_PROBLEMS = pytest.StashKey[dict[str, list[str]]]()

_REPO = Path(__file__).resolve().parents[1]
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty"}
)
_SOCKET_EVENTS = frozenset({"socket.bind", "socket.connect"})


def _model_dirs() -> tuple[str, ...]:
    """Where real models live: the repository's and the package's model folders, and the fetched models' cache."""
    cache = os.environ.get("SPECSERVE_MODEL_CACHE") or str(Path.home() / ".cache" / "specserve")
    return tuple(str(p) + os.sep for p in (_REPO / "models", _REPO / "specserve" / "models", Path(cache)))


def _sockets() -> set[int]:
    """Inodes of the sockets this process holds open (Linux /proc; empty elsewhere)."""
    inodes = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listening(inodes: set[int]) -> bool:
    """Whether one of the sockets ``inodes`` listens on a TCP port (read from /proc only when asked: it is slow)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                rows = map(str.split, f)
                if any(row[3] == "0A" and int(row[9]) in inodes for row in rows):  # 0A: LISTEN
                    return True
        except OSError:
            continue
    return False


class UnitGuard:
    """Records what a unit test does outside this process (see the module docstring); one per session."""

    def __init__(self) -> None:
        self.active = False
        self.violations: list[str] = []
        self._sockets: set[int] = set()
        self._model_dirs = _model_dirs()
        sys.addaudithook(self._audit)  # stays for the process; it does nothing unless a unit test runs

    def _audit(self, event: str, args: tuple) -> None:
        if not self.active or threading.current_thread() is not threading.main_thread():
            return
        if event in _PROCESS_EVENTS:
            self.violations.append(f"started a process ({event} {args[0]!r})")
        elif event in _SOCKET_EVENTS:
            self.violations.append(f"opened a socket ({event} {args[1]!r})")
        elif event == "open" and isinstance(args[0], (str, os.PathLike)):
            path = os.path.abspath(os.fspath(args[0]))
            if path.startswith(self._model_dirs):
                self.violations.append(f"opened a real model's file ({path})")

    def start(self) -> None:
        self.violations.clear()
        self._sockets = _sockets()
        self.active = True

    def stop(self) -> list[str]:
        """Stop watching; what the test did that a unit test must not."""
        self.active = False
        new = _sockets() - self._sockets
        if new and _listening(new):
            self.violations.append("left this process listening on a new port (a server)")
        return list(self.violations)
