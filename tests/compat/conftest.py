"""The compatibility suite's stack: one real ``specserve up`` (the tiny test pair, on the shared Redis) for
every tool's run, started as a user starts it, as a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import system_fixtures as sf
from waiting import wait_until_blocking

from specserve.launch.redis_server import free_port


@dataclass(frozen=True)
class Server:
    """A running ``specserve up``: its OpenAI API's base URL (``.../v1``), the model it serves, and the
    tokenizer directory the tools count tokens with."""

    base_url: str
    model: str
    tokenizer_dir: Path

    @property
    def root(self) -> str:
        """The API's host and port, without ``/v1`` (where ``/metrics`` and ``/version`` are)."""
        return self.base_url.removesuffix("/v1")


@pytest.fixture(scope="session")
def server(tmp_path_factory, redis_server) -> Iterator[Server]:
    pair = sf.tiny_pair(tmp_path_factory)
    work = tmp_path_factory.mktemp("compat-up")
    out = work / "stdout.txt"
    code = "import sys\nfrom specserve.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    args = [
        sys.executable, "-c", code, "up", "--target-model", str(pair.target_dir), "--draft-model",
        str(pair.draft_dir), "--port", str(free_port()), "--http-port", "0", "--redis-url", redis_server.url,
    ]  # fmt: skip
    with out.open("wb") as stdout, (work / "stderr.txt").open("wb") as stderr:
        proc = subprocess.Popen(args, cwd=work, stdout=stdout, stderr=stderr, env={**os.environ})
    try:
        wait_until_blocking(
            lambda: proc.poll() is not None or "stop with Ctrl-C" in out.read_text(),
            timeout_s=300,
            what="specserve up to serve",
        )
        assert proc.poll() is None, f"specserve up exited: {(work / 'stderr.txt').read_text()[-3000:]}"
        found = re.search(r"OpenAI-compatible API: (\S+) \(model '([^']+)'", out.read_text())
        assert found, out.read_text()
        yield Server(base_url=found.group(1), model=found.group(2), tokenizer_dir=pair.target_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
