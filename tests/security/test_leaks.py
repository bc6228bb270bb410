"""No secret and no internal leaves a server: not from a settings error, not in a client-facing message.

* Settings that fail validation: ``specserve serve ROLE`` exits with status 2 naming the field and what
  is wrong, and neither stdout nor stderr carries a token or the Redis password (pydantic's own text
  would: the control below shows it quoting the inputs).
* A session the store cannot take (Redis full: ``maxmemory`` with ``noeviction``) is refused with
  UNAVAILABLE and "the session store is full", not Redis's "OOM ... maxmemory" text; the details are in
  the server's log with the request id.
* With every target down, the final UNAVAILABLE names no worker address (gRPC's own details do).
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
import redis.asyncio as aioredis
import structlog
import system_fixtures as sf
from pydantic import ValidationError
from security_helpers import running_roles

from specserve.api.status import RETRY_AFTER_KEY
from specserve.launch.redis_server import RedisServer
from specserve.runtime.config import CoordinatorSettings, describe_errors
from specserve.runtime.logs import configure_logging

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

REPO = Path(__file__).resolve().parents[2]
TOKEN = f"tok-{uuid.uuid4().hex[:8]}"
WORKER_TOKEN = f"wt-{uuid.uuid4().hex[:8]}"
PASSWORD = f"pw-{uuid.uuid4().hex[:8]}"
PROMPT = [5, 6, 7, 8]


# --------------------------------------------------------------------------- settings errors


async def test_pydantics_own_text_would_quote_a_secret_and_ours_does_not():
    """Control for the test below: the raw validation error carries an input, our description does not."""
    with pytest.raises(ValidationError) as info:
        CoordinatorSettings(default_max_new_tokens=10**6, auth_tokens=TOKEN)
    assert TOKEN in str(info.value)
    described = describe_errors(info.value)
    assert TOKEN not in described and "default_max_new_tokens must not exceed max_new_tokens_limit" in described


@pytest.mark.parametrize(
    ("role", "bad", "field"),
    [
        ("coordinator", ["--default-max-new-tokens", "1000000"], "default_max_new_tokens"),
        ("coordinator", ["--max-sessions", "zero"], "max_sessions"),
        ("target", ["--host", "0.0.0.0", "--tls-client-names", "coordinator"], "tls_ca_file"),
        ("draft", ["--max-gamma", "999"], "max_gamma"),
    ],
)
async def test_settings_that_fail_validation_print_no_secret(role, bad, field):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SPECSERVE_REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:6379/0",
        "SPECSERVE_WORKER_TOKEN": WORKER_TOKEN,
        "SPECSERVE_LOG_FORMAT": "json",
    }
    if role == "coordinator":
        env["SPECSERVE_AUTH_TOKENS"] = f"{TOKEN},{TOKEN}-2"
    out = subprocess.run(
        [sys.executable, "-m", "specserve.launch.cli", "serve", role, *bad],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"invalid {role} settings" in out.stderr and field in out.stderr, out.stderr
    for secret in (TOKEN, WORKER_TOKEN, PASSWORD):
        assert secret not in out.stdout + out.stderr


# --------------------------------------------------------------------------- client-facing messages


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-full")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def captured_logs():
    buffer = io.StringIO()
    configure_logging("json", "info", stream=buffer)
    yield buffer
    structlog.reset_defaults()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(captured_logs, sec_pair, sec_models, own_redis):
    coordinator = {
        "max_verify_attempts": 3,
        "all_down_wait_s": 1.0,
        "target_backoff_s": 0.2,
        "target_max_backoff_s": 0.5,
        "rpc_timeout_s": 5.0,
    }
    async with running_roles(sec_pair, sec_models, own_redis.url, coordinator=coordinator) as r:
        yield r


async def _refused(address: str, request_id: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with grpc.aio.insecure_channel(address) as channel:
            from specserve.v1 import coordinator_pb2_grpc

            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            async for _ in stub.Generate(
                sf.request(PROMPT, max_new_tokens=4), timeout=60, metadata=(("x-request-id", request_id),)
            ):
                pass
    return info.value


async def test_a_full_session_store_is_reported_without_redis_text(roles, own_redis, captured_logs):
    admin = aioredis.Redis.from_url(own_redis.url)
    try:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.set("ballast", b"x" * 2_000_000)
        await admin.config_set("maxmemory", "1mb")
        request_id = f"req-{uuid.uuid4().hex}"
        refused = await _refused(roles.address, request_id)
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.delete("ballast")
        await admin.aclose()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.details() == "the session store is full; retry later"
    assert dict(refused.trailing_metadata() or ())[RETRY_AFTER_KEY] == "1"
    # The details are in the log, under the request's id.
    events = [json.loads(line) for line in captured_logs.getvalue().splitlines() if line.startswith("{")]
    logged = [e for e in events if e.get("event") == "redis_error" and e.get("request_id") == request_id]
    assert logged and "maxmemory" in logged[0]["detail"]
    out = await sf.generate(roles.address, sf.request(PROMPT, max_new_tokens=4))  # and the store recovers
    assert len(out.token_ids) == 4


async def test_every_target_down_fails_with_unavailable_naming_no_address(roles):
    """The final UNAVAILABLE once every target is gone: after the configured attempts and wait, with a
    retry hint, and without the workers' addresses that gRPC's own details carry."""
    await roles.target.stop(0)
    refused = await _refused(roles.address, f"req-{uuid.uuid4().hex}")
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "no target replica could verify session" in refused.details() and "retry shortly" in refused.details()
    assert "127.0.0.1" not in refused.details() and str(roles.target.port) not in refused.details()
    assert dict(refused.trailing_metadata() or ())[RETRY_AFTER_KEY] == "1"

