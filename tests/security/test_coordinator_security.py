"""The coordinator's client-facing security: bearer tokens, session limits, and secrets kept out of logs.

One stack for the module: a password-protected redis-server, a coordinator
that accepts three tokens and allows 2 sessions in total and 1 per client, a
delay proxy between the coordinator and the target (so a session can be held
open for as long as a test needs). Logging is configured as the entry points
do (JSON, the secrets from ``settings_secrets``) into a buffer before anything
starts, so the last test can grep everything the module's run logged.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import structlog
import system_fixtures as sf
from pydantic import SecretStr, ValidationError
from security_helpers import running_roles
from waiting import wait_until

from specserve.api import errors
from specserve.api.status import RETRY_AFTER_KEY
from specserve.client import AsyncClient
from specserve.launch.redis_server import RedisServer
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.logs import configure_logging, settings_secrets
from specserve.v1 import coordinator_pb2_grpc

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

TOKENS = {name: f"tok-{name}-{uuid.uuid4().hex}" for name in ("a", "b", "c")}
REDIS_PASSWORD = f"pw-{uuid.uuid4().hex}"
WORKER_TOKEN = f"wt-{uuid.uuid4().hex}"
PROMPT = [5, 6, 7, 8]
REPO = Path(__file__).resolve().parents[2]
#: Seconds the proxy adds to each chunk while a session is being held open.
HOLD_DELAY_S = 0.2


@pytest.fixture(scope="module")
def secret_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-pw"), password=REDIS_PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def captured_logs():
    """structlog configured like an entry point (JSON, debug, secrets redacted) into a buffer."""
    buffer = io.StringIO()
    settings = CoordinatorSettings(
        host="127.0.0.1",
        redis_url=SecretStr(f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0"),
        auth_tokens=[SecretStr(t) for t in TOKENS.values()],
        worker_token=SecretStr(WORKER_TOKEN),
    )
    secrets = settings_secrets(settings)
    assert set(secrets) == {*TOKENS.values(), REDIS_PASSWORD, WORKER_TOKEN}
    configure_logging("json", "debug", secrets=secrets, stream=buffer)
    yield buffer
    structlog.reset_defaults()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(captured_logs, sec_pair, sec_models, secret_redis):
    assert REDIS_PASSWORD in secret_redis.url
    coordinator = {
        "auth_tokens": [SecretStr(t) for t in TOKENS.values()],
        "max_sessions": 2,
        "max_sessions_per_client": 1,
        "max_prompt_tokens": 64,
        "max_new_tokens_limit": 32,
        "default_max_new_tokens": 16,
        "max_message_bytes": 64 * 1024,
        "worker_token": SecretStr(WORKER_TOKEN),
    }
    worker = {"worker_token": SecretStr(WORKER_TOKEN)}
    async with running_roles(
        sec_pair, sec_models, secret_redis.url, worker=worker, coordinator=coordinator, proxy_target=True
    ) as r:
        yield r


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _generate(address: str, req, metadata=()) -> sf.Generated:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        chunks, stats = [], None
        async for reply in stub.Generate(req, timeout=60, metadata=metadata):
            if reply.WhichOneof("event") == "chunk":
                chunks.append(reply.chunk)
            else:
                stats = reply.stats
        return sf.Generated(chunks, stats)


async def _refused(address: str, req, metadata=()) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _generate(address, req, metadata)
    return info.value


async def test_generate_needs_a_valid_bearer_token(roles):
    req = sf.request(PROMPT, max_new_tokens=4, gamma=2, ignore_eos=True)
    assert (await _refused(roles.address, req)).code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = await _refused(roles.address, req, _auth("not-a-token"))
    assert wrong.code() == grpc.StatusCode.PERMISSION_DENIED
    malformed = await _refused(roles.address, req, (("authorization", "Basic abc"),))
    assert malformed.code() == grpc.StatusCode.PERMISSION_DENIED
    out = await _generate(roles.address, req, _auth(TOKENS["a"]))
    assert out.stats is not None and out.stats.completion_tokens == 4
    # The SDK maps the refusal to its exception.
    async with AsyncClient(roles.address, token="not-a-token", retries=0) as client:
        with pytest.raises(errors.PermissionDenied):
            await client.generate(prompt_token_ids=PROMPT, max_new_tokens=2)


async def test_request_size_limits(roles):
    """Over-long prompts and max_new_tokens are INVALID_ARGUMENT (resending cannot help); an oversize
    message is refused by gRPC itself with RESOURCE_EXHAUSTED; the server keeps serving."""
    auth = _auth(TOKENS["a"])
    too_long = await _refused(roles.address, sf.request(list(range(1, 66)), max_new_tokens=4), auth)
    assert too_long.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 64" in too_long.details()
    too_many = await _refused(roles.address, sf.request(PROMPT, max_new_tokens=33), auth)
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 32" in too_many.details()
    huge = sf.request([300] * 40_000, max_new_tokens=4)  # about 80 KB on the wire, over the 64 KiB limit
    assert huge.ByteSize() > 64 * 1024
    assert (await _refused(roles.address, huge, auth)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    out = await _generate(
        roles.address, sf.request(PROMPT, max_new_tokens=32, gamma=0, ignore_eos=True), auth
    )
    assert out.stats is not None and out.stats.completion_tokens == 32


class _Held:
    """A Generate stream opened and read up to its first chunk, then left running until cancelled."""

    def __init__(self, address: str, token: str | None) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        req = sf.request(PROMPT, max_new_tokens=32, gamma=0, ignore_eos=True)
        self.call = stub.Generate(req, timeout=120, metadata=_auth(token) if token else ())

    async def start(self) -> _Held:
        first = await self.call.read()
        assert first.WhichOneof("event") == "chunk"
        return self

    async def cancel(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def test_session_limits_refuse_with_a_retry_hint_while_others_are_served(roles):
    small = sf.request(PROMPT, max_new_tokens=2, gamma=0, ignore_eos=True)
    roles.proxy.delay_s = HOLD_DELAY_S  # each round now takes >= 2 * HOLD_DELAY_S: sessions stay open
    held = []
    try:
        held.append(await _Held(roles.address, TOKENS["a"]).start())
        assert roles.coordinator.coordinator.active_sessions == 1

        # Client a is at its limit of 1: refused with a retry hint (raw gRPC and the SDK).
        refused = await _refused(roles.address, small, _auth(TOKENS["a"]))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this client" in refused.details()
        assert dict(refused.trailing_metadata() or ())[RETRY_AFTER_KEY] == "1"
        async with AsyncClient(roles.address, token=TOKENS["a"], retries=0, rate_limit_retries=0) as client:
            with pytest.raises(errors.ResourceExhausted) as info:
                await client.generate(prompt_token_ids=PROMPT, max_new_tokens=2, gamma=0)
            assert info.value.retry_after_s == 1.0

        # Client b is served meanwhile.
        out = await _generate(roles.address, small, _auth(TOKENS["b"]))
        assert out.stats is not None and out.stats.completion_tokens == 2

        # b holds one too: the total of 2 is reached, so c (under its own limit) is refused.
        held.append(await _Held(roles.address, TOKENS["b"]).start())
        refused = await _refused(roles.address, small, _auth(TOKENS["c"]))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "maximum of 2 sessions" in refused.details()
        assert dict(refused.trailing_metadata() or ())[RETRY_AFTER_KEY] == "1"
    finally:
        roles.proxy.delay_s = 0.0
        for h in held:
            await h.cancel()
    # Once the held sessions end, a is served again.
    await wait_until(
        lambda: roles.coordinator.coordinator.active_sessions == 0, timeout_s=10, what="every session's end"
    )
    out = await _generate(roles.address, small, _auth(TOKENS["a"]))
    assert out.stats is not None and out.stats.completion_tokens == 2


async def test_no_secret_in_logs_and_one_request_id_across_all_three_roles(roles, captured_logs):
    request_id = f"req-{uuid.uuid4().hex}"
    req = sf.request(PROMPT, max_new_tokens=6, gamma=2, ignore_eos=True)
    out = await _generate(roles.address, req, (*_auth(TOKENS["c"]), ("x-request-id", request_id)))
    assert out.stats is not None and out.stats.proposed_tokens > 0
    await roles.coordinator.coordinator.drain()  # the releases to both workers are logged too
    # Control: a careless event carrying secrets is redacted by the configured processor.
    structlog.get_logger("test").warning(
        "careless",
        url=secret_redis_url(),
        header=f"Bearer {TOKENS['b']}",
        nested={"t": TOKENS["a"]},
        worker=f"Bearer {WORKER_TOKEN}",
    )

    text = captured_logs.getvalue()
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(events) > 20
    for secret in (*TOKENS.values(), REDIS_PASSWORD, WORKER_TOKEN):
        assert secret not in text
    careless = next(e for e in events if e["event"] == "careless")
    assert careless["url"] == "redis://:***@127.0.0.1/0" and careless["header"] == "Bearer ***"
    assert careless["worker"] == "Bearer ***"
    assert "***" in careless["nested"]

    # One request id in the coordinator's, the draft's and the target's events (by the RPC they served).
    rpcs = {e.get("rpc") for e in events if request_id in (e.get("request_id") or "").split(",")}
    assert "Generate" in rpcs, "coordinator"
    assert {"ProposeBatch", "ReleaseDraftSession"} <= rpcs, "draft"  # model proposals travel batched
    assert {"Verify", "ReleaseTargetSession"} <= rpcs, "target"
    # Session events name the session.
    sid = out.stats.session_id
    by_session = {e["event"] for e in events if e.get("session_id") == sid}
    assert {"session_started", "session_finished", "proposed", "verified", "session_released"} <= by_session


def secret_redis_url() -> str:
    return f"redis://:{REDIS_PASSWORD}@127.0.0.1/0"


async def test_without_auth_the_per_client_limit_keys_on_the_peer_address_where_opted_in(
    sec_pair, sec_models, redis_server
):
    """Auth off and client_limits_by_address on: every local client is 127.0.0.1, so a second concurrent
    session from here is refused. (Without the opt-in such callers have no per-client limit:
    tests/security/test_client_limits.py.)"""
    limits = {"max_sessions_per_client": 1, "client_limits_by_address": True}
    async with running_roles(
        sec_pair, sec_models, redis_server.url, coordinator=limits, proxy_target=True
    ) as r:
        r.proxy.delay_s = HOLD_DELAY_S
        held = _Held(r.address, token=None)
        try:
            await held.start()
            refused = await _refused(r.address, sf.request(PROMPT, max_new_tokens=2, gamma=0))
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "this client" in refused.details()
            # A token does not make a new client while authentication is off.
            refused = await _refused(r.address, sf.request(PROMPT, max_new_tokens=2), _auth("made-up"))
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            r.proxy.delay_s = 0.0
            await held.cancel()


# --------------------------------------------------------------------------- where the coordinator listens


async def test_a_coordinator_beyond_loopback_without_client_authentication_refuses_to_start():
    """As the workers do: beyond loopback the coordinator needs auth_tokens or mutual TLS, or --insecure."""
    for host in ("0.0.0.0", "::", "10.1.2.3", "coordinator.specserve.svc"):
        with pytest.raises(ValidationError, match="without authenticating its clients"):
            CoordinatorSettings(host=host)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert CoordinatorSettings(host=host).host == host
    assert CoordinatorSettings(host="0.0.0.0", auth_tokens=[SecretStr("t")]).authenticates_clients
    assert not CoordinatorSettings(host="0.0.0.0", insecure=True).authenticates_clients


async def test_specserve_serve_refuses_a_public_coordinator_without_auth_unless_insecure():
    """The command line exits with status 2 and says what to do; with --insecure it gets past the check
    (and then fails on the port given, proving it tried to start)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    env["PYTHONPATH"] = str(REPO)
    base = [sys.executable, "-m", "specserve.launch.cli", "serve", "coordinator", "--host", "0.0.0.0"]
    refused = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "auth_tokens" in refused.stderr and "--insecure" in refused.stderr
    insecure = subprocess.run([*base, "--insecure", "--port", "70000"], capture_output=True, text=True, env=env, timeout=120)
    assert insecure.returncode == 2 and "port" in insecure.stderr and "auth_tokens" not in insecure.stderr
