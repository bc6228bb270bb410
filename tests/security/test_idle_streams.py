"""Clients that stop reading, or vanish, do not hold their sessions: idle timeout and keepalive.

One stack (real servers on 127.0.0.1, the session's real Redis, tiny float32 models) whose coordinator has
``stream_idle_timeout_s`` = 1.5 and pings its clients every second (``keepalive_time_s``, answer within
``keepalive_timeout_s`` = 1). A delay proxy between the coordinator and the target slows rounds on demand,
so a session is still running when the test looks.

* A client that reads one message and then nothing more, with a small HTTP/2 window: once its window is
  full the coordinator cannot write; after the idle timeout the session is cancelled (not finished, fewer
  tokens than asked), its caches are released on the draft and the target, its slot is free, and the client,
  reading again, gets DEADLINE_EXCEEDED saying why.
* A client whose connection goes silent (a frozen proxy: no FIN, no data, no ping answers) while its
  session runs: the keepalive closes the connection and the session is cancelled and released the same way.
"""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from security_helpers import running_roles
from tcp_proxy import DelayProxy
from waiting import wait_until

from specserve.runtime.store import SessionStore
from specserve.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 6, 7, 8]
IDLE_S = 1.5
#: A client channel that never lets its receive window grow past about 1 KiB.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(sec_pair, sec_models, redis_server):
    coordinator = {
        "stream_idle_timeout_s": IDLE_S,
        "keepalive_time_s": 1.0,
        "keepalive_timeout_s": 1.0,
        "keep_ended_sessions_s": 600.0,  # the tests read an ended session's log
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


def _sessions(roles) -> set[str]:
    return set(roles.target.caches.session_ids())


async def _released(roles, sid: str, timeout_s: float) -> None:
    """Wait until the session holds no slot and no cache anywhere."""
    await wait_until(
        lambda: roles.coordinator.coordinator.active_sessions == 0
        and sid not in _sessions(roles)
        and sid not in roles.draft.caches,
        timeout_s=timeout_s,
        what=f"session {sid} to hold no slot and no cache",
    )


async def test_a_stream_whose_client_stops_reading_is_cancelled_after_the_idle_timeout(roles, store):
    before = _sessions(roles)
    roles.proxy.delay_s = 0.0
    async with grpc.aio.insecure_channel(roles.address, options=SMALL_WINDOW) as channel:
        call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
            sf.request(PROMPT, max_new_tokens=480, gamma=0, ignore_eos=True), timeout=120
        )
        first = await call.read()
        assert first.WhichOneof("event") == "chunk"
        (sid,) = _sessions(roles) - before
        await _released(roles, sid, timeout_s=30)  # the client reads nothing meanwhile
        record = await store.load(sid)
        assert not record.finished and len(record.generated_token_ids) < 480, "the session ran to its end"
        # Reading again: what was buffered, then the status saying why the call ended.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while (await call.read()) is not grpc.aio.EOF:
                pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"took no message for {IDLE_S:g} s" in info.value.details()


async def test_a_client_that_vanishes_is_found_by_keepalive_and_its_session_released(roles, store):
    before = _sessions(roles)
    roles.proxy.delay_s = 0.05  # each round now takes >= 0.1 s: the session would run for a minute
    client_link = await DelayProxy("127.0.0.1", roles.coordinator.port).start()
    try:
        async with grpc.aio.insecure_channel(client_link.address) as channel:
            call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
                sf.request(PROMPT, max_new_tokens=480, gamma=0, ignore_eos=True), timeout=120
            )
            assert (await call.read()).WhichOneof("event") == "chunk"
            (sid,) = _sessions(roles) - before
            client_link.freeze()  # the client is gone: no FIN, no data, no answer to pings
            await _released(roles, sid, timeout_s=15)
            record = await store.load(sid)
            assert not record.finished and len(record.generated_token_ids) < 480
            call.cancel()
    finally:
        roles.proxy.delay_s = 0.0
        await client_link.stop()
