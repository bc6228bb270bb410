"""Sessions do not pile up: a session's keys leave Redis when it ends, and a client starts new sessions
at a bounded rate.

One stack for the module: target, draft and coordinator (gRPC and HTTP, bearer tokens for two clients)
on loopback, with a delay proxy before the target so that a session can be held open; the coordinator
lets each client start 3 sessions at once and refills that so slowly that no fourth fits in a test.
"""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest
import pytest_asyncio
import system_fixtures as sf
from pydantic import SecretStr
from security_helpers import running_roles
from waiting import wait_until

from specserve.api.status import RETRY_AFTER_KEY
from specserve.runtime.store import SessionStore
from specserve.v1 import coordinator_pb2_grpc

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

TOKENS = {name: f"tok-{name}-{uuid.uuid4().hex}" for name in ("a", "b", "c")}
PROMPT = [5, 6, 7, 8]
BURST = 3


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(sec_pair, sec_models, redis_server):
    coordinator = {
        "http_port": 0,
        "auth_tokens": [SecretStr(t) for t in TOKENS.values()],
        "session_rate_per_client": 0.001,  # one more session per 1000 s: none within a test
        "session_burst_per_client": BURST,
    }
    async with running_roles(
        sec_pair, sec_models, redis_server.url, coordinator=coordinator, proxy_target=True
    ) as r:
        yield r


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()


@pytest.fixture
def url(roles) -> str:
    return roles.coordinator.http.url


async def _session_ids(store: SessionStore) -> set[str]:
    return set(await store.session_ids())


async def test_a_finished_and_a_cancelled_sessions_keys_leave_redis_and_a_running_ones_stay(roles, store):
    """Client a: one session run to its end, one cancelled while it runs (2 of its burst of 3)."""
    out = await sf.generate(
        roles.address, sf.request(PROMPT, max_new_tokens=4, gamma=2, ignore_eos=True), metadata=_auth(TOKENS["a"])
    )
    assert len(out.token_ids) == 4
    finished = out.stats.session_id
    await wait_until(lambda: _gone(store, finished), timeout_s=20, what="the finished session's keys to go")

    before = await _session_ids(store)
    roles.proxy.delay_s = 0.2  # rounds are slow now: the session is still running when it is looked at
    channel = grpc.aio.insecure_channel(roles.address)
    try:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        call = stub.Generate(
            sf.request(PROMPT, max_new_tokens=32, gamma=0, ignore_eos=True), timeout=120, metadata=_auth(TOKENS["a"])
        )
        first = await call.read()
        assert first.WhichOneof("event") == "chunk"
        (running,) = await _session_ids(store) - before
        assert await store.exists(running), "a running session's log stays (replay and failover read it)"
        assert await store.lease_owner(running) == roles.coordinator.coordinator.owner
        call.cancel()
    finally:
        roles.proxy.delay_s = 0.0
        await channel.close()
    await wait_until(lambda: _gone(store, running), timeout_s=20, what="the cancelled session's keys to go")


async def _gone(store: SessionStore, session_id: str) -> bool:
    return not await store.exists(session_id) and await store.lease_owner(session_id) is None


async def test_a_client_past_its_rate_of_new_sessions_is_refused_with_a_retry_hint_others_are_served(roles, url):
    """Client b starts its burst of 3 (gRPC and HTTP count alike); the 4th is RESOURCE_EXHAUSTED / 429 with
    a hint of when to retry, while client c is served."""
    small = sf.request(PROMPT, max_new_tokens=2, gamma=0, ignore_eos=True)
    for _ in range(BURST - 1):
        assert len((await sf.generate(roles.address, small, metadata=_auth(TOKENS["b"]))).token_ids) == 2
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        ok = await http.post(f"{url}/completions", json=body, headers={"authorization": f"Bearer {TOKENS['b']}"})
        assert ok.status_code == 200, ok.text
        refused = await http.post(f"{url}/completions", json=body, headers={"authorization": f"Bearer {TOKENS['b']}"})
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "per second" in error["message"]
        assert int(refused.headers["retry-after"]) > 100
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sf.generate(roles.address, small, metadata=_auth(TOKENS["b"]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per second" in info.value.details()
    assert float(dict(info.value.trailing_metadata() or ())[RETRY_AFTER_KEY]) > 100
    # Another client is not held back by b.
    assert len((await sf.generate(roles.address, small, metadata=_auth(TOKENS["c"]))).token_ids) == 2


async def test_n_choices_count_against_the_rate_and_none_starts_when_they_do_not_fit(roles, url):
    """Client c has 2 left of its burst (one used above): n = 3 is refused whole, n = 2 fits."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    headers = {"authorization": f"Bearer {TOKENS['c']}"}
    async with httpx.AsyncClient(timeout=60) as http:
        refused = await http.post(f"{url}/completions", json={**body, "n": 3}, headers=headers)
        assert refused.status_code == 429, refused.text
        ok = await http.post(f"{url}/completions", json={**body, "n": 2}, headers=headers)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
