"""SessionStore against a real redis-server: create, atomic commit, replay, conflicts."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest

from specserve.api.errors import (
    Aborted,
    FailedPrecondition,
    NotFound,
    SessionFinished,
    Unavailable,
    VersionConflict,
)
from specserve.api.params import PositionLogprobs, SamplingParams, StopConditions, TokenLogprob, Verdict
from specserve.runtime.store import SessionStore

pytestmark = pytest.mark.system


def sid() -> str:
    return f"t-{uuid.uuid4().hex}"


def verdict(tokens, base_len, base_version, finish=0) -> Verdict:
    return Verdict(
        accepted_count=len(tokens) - 1,
        committed_token_ids=tuple(tokens),
        bonus=False,
        new_version=base_version + 1,
        committed_len=base_len + len(tokens),
        finish_reason=finish,
    )


async def test_create_load_roundtrip(store: SessionStore):
    s = sid()
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=42)
    stop = StopConditions(max_new_tokens=12, stop_token_ids=(3,), stop_strings=("\n\n",))
    await store.create(s, [5, 6, 7], sampling, stop)
    rec = await store.load(s)
    assert rec.token_ids == (5, 6, 7) and rec.prompt_len == 3 and rec.version == 0
    assert rec.sampling == sampling and rec.stop == stop
    assert rec.last_verdict is None and not rec.finished
    with pytest.raises(Aborted):
        await store.create(s, [1], sampling, stop)


async def test_commit_appends_and_bumps_version(store: SessionStore):
    s = sid()
    await store.create(s, [1, 2], SamplingParams(), StopConditions())
    v1, replayed = await store.commit(s, 0, verdict([9, 8], 2, 0))
    assert not replayed
    v2, _ = await store.commit(s, 1, verdict([7], 4, 1))
    rec = await store.load(s)
    assert rec.token_ids == (1, 2, 9, 8, 7) and rec.version == 2
    assert rec.last_verdict == v2
    assert await store.read_tokens(s, start=2) == (9, 8, 7)
    assert v1.new_version == 1


async def test_retried_commit_replays_and_appends_nothing(store: SessionStore):
    s = sid()
    await store.create(s, [1], SamplingParams(), StopConditions())
    first, _ = await store.commit(s, 0, verdict([4, 5], 1, 0))
    # The reply was lost; the retry carries a freshly sampled (different) verdict.
    again, replayed = await store.commit(s, 0, verdict([6], 1, 0))
    assert replayed and again == first
    assert (await store.load(s)).token_ids == (1, 4, 5)


async def test_a_verdicts_logprobs_are_recorded_and_replayed_bit_for_bit(store: SessionStore):
    """The logprobs recorded with a verdict come back from a retried commit and from load, unchanged:
    a retried Verify returns what the first one reported."""
    s = sid()
    await store.create(s, [1], SamplingParams(), StopConditions())
    logprobs = (
        PositionLogprobs(4, -0.1234567890123456789, (TokenLogprob(4, -0.1234567890123456789), TokenLogprob(9, -2.5))),
        PositionLogprobs(5, -1e-300, ()),
    )
    first, _ = await store.commit(s, 0, dataclasses.replace(verdict([4, 5], 1, 0), logprobs=logprobs))
    again, replayed = await store.commit(s, 0, verdict([6], 1, 0))
    assert replayed and again == first and again.logprobs == logprobs
    assert (await store.load(s)).last_verdict.logprobs == logprobs


async def test_stale_version_conflicts(store: SessionStore):
    s = sid()
    await store.create(s, [1], SamplingParams(), StopConditions())
    await store.commit(s, 0, verdict([2], 1, 0))
    await store.commit(s, 1, verdict([3], 2, 1))
    with pytest.raises(VersionConflict):
        await store.commit(s, 0, verdict([9], 1, 0))  # two versions behind: no replay
    with pytest.raises(VersionConflict):
        await store.commit(s, 5, verdict([9], 3, 5))
    assert (await store.load(s)).token_ids == (1, 2, 3)


async def test_length_mismatch_and_finished_and_missing(store: SessionStore):
    s = sid()
    await store.create(s, [1, 2, 3], SamplingParams(), StopConditions())
    with pytest.raises(FailedPrecondition):
        await store.commit(s, 0, verdict([4], 5, 0))
    await store.commit(s, 0, verdict([4], 3, 0, finish=1))
    with pytest.raises(SessionFinished):
        await store.commit(s, 1, verdict([5], 4, 1))
    with pytest.raises(NotFound):
        await store.load(sid())
    with pytest.raises(NotFound):
        await store.commit(sid(), 0, verdict([1], 1, 0))


async def test_concurrent_commits_exactly_one_wins(store: SessionStore):
    s = sid()
    await store.create(s, [1], SamplingParams(), StopConditions())
    results = await asyncio.gather(
        *[store.commit(s, 0, verdict([10 + i], 1, 0)) for i in range(8)], return_exceptions=True
    )
    fresh = [r for r in results if isinstance(r, tuple) and not r[1]]
    replays = [r for r in results if isinstance(r, tuple) and r[1]]
    assert len(fresh) == 1
    # Every other writer either saw the recorded verdict (same base) or nothing was appended twice.
    assert all(r[0] == fresh[0][0] for r in replays)
    assert len((await store.load(s)).token_ids) == 2


async def test_lease(store: SessionStore):
    s = sid()
    assert await store.acquire_lease(s, "a", 5)
    assert await store.acquire_lease(s, "a", 5)
    assert not await store.acquire_lease(s, "b", 5)
    await store.release_lease(s, "a")
    assert await store.acquire_lease(s, "b", 5)


async def test_an_ended_session_is_deleted_or_kept_for_a_while_and_another_owners_is_left_alone(store: SessionStore):
    params = (SamplingParams(), StopConditions(max_new_tokens=4))
    gone, kept, taken = sid(), sid(), sid()
    for s in (gone, kept, taken):
        await store.create(s, [1, 2], *params)
    await store.acquire_lease(gone, "a", 30)
    await store.acquire_lease(kept, "a", 30)
    await store.acquire_lease(taken, "b", 30)
    await store.end(gone, "a")
    assert not await store.exists(gone) and await store.lease_owner(gone) is None
    await store.end(kept, "a", keep_s=60)
    assert (await store.load(kept)).token_ids == (1, 2) and await store.lease_owner(kept) is None
    meta, tokens, _ = store.keys(kept)
    assert 0 < await store.redis.pttl(meta) <= 60_000 and 0 < await store.redis.pttl(tokens) <= 60_000
    await store.end(taken, "a")  # b drives it now
    assert await store.exists(taken) and await store.lease_owner(taken) == "b"


async def test_redis_down_is_unavailable(tmp_path):
    from specserve.launch.redis_server import free_port

    store = SessionStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(Unavailable):
        await store.load("x")
    await store.close()


async def test_load_with_known_settings_reads_only_what_moves(store: SessionStore):
    """Given the settings of an earlier load, ``load`` returns the same record without reading them again
    (so a round's read does not grow with a session's stop list), and still sees every commit."""
    s = sid()
    stop = StopConditions(max_new_tokens=12, stop_strings=("a" * 50,) * 16)
    await store.create(s, (1, 2), SamplingParams(temperature=0.7, seed=3), stop)
    first = await store.load(s)
    await store.commit(s, 0, verdict([9], 2, 0))
    full, light = await store.load(s), await store.load(s, settings=first.settings)
    assert light == full and light.token_ids == (1, 2, 9) and light.version == 1
    # The light read asks Redis for the moving fields only: the stop list is not among them.
    meta, _, _ = store.keys(s)
    await store.redis.hset(meta, "stop", "not json")
    assert (await store.load(s, settings=first.settings)).stop == stop
    with pytest.raises(FailedPrecondition):
        await store.load(s)
    with pytest.raises(NotFound):
        await store.load(sid(), settings=first.settings)


async def test_a_record_from_a_newer_version_is_refused_naming_what_it_does_not_know(store: SessionStore):
    """A rolling upgrade: a session created by a newer specserve carries a setting this one lacks. Serving it
    without that setting would not be the session's output, so the load is refused, naming the field;
    a record that lacks a field this version added (an older writer) loads with its default."""
    import json

    s = sid()
    await store.create(s, (1, 2), SamplingParams(temperature=0.7, seed=3), StopConditions(max_new_tokens=4))
    meta, _, _ = store.keys(s)
    sampling = json.loads(await store.redis.hget(meta, "sampling"))
    await store.redis.hset(meta, "sampling", json.dumps({**sampling, "typical_p": 0.9}))
    with pytest.raises(FailedPrecondition, match=r"does not know \(typical_p\).*upgraded replica"):
        await store.load(s)
    del sampling["constraint"]  # as written before constraints existed
    await store.redis.hset(meta, "sampling", json.dumps(sampling))
    assert (await store.load(s)).sampling == SamplingParams(temperature=0.7, seed=3)


async def test_redis_errors_reach_callers_without_redis_text(store: SessionStore):
    """A command Redis refuses (here: a Lua script error) becomes Unavailable with a message of our own;
    Redis's text (script hash, error detail) stays in the server log."""
    await store.redis.set(store.keys("broken")[0], "a string, not a hash")
    with pytest.raises(Unavailable) as info:
        await store.commit("broken", 0, verdict([9], 2, 0))
    assert info.value.message == "the session store refused the command (ResponseError); retry later"
    assert "WRONGTYPE" not in info.value.message and "f_" not in info.value.message


async def test_a_redis_that_stops_answering_fails_each_command_after_its_timeout_and_retries(redis_url):
    """A Redis that accepts the connection and then says nothing (a frozen link): each attempt waits the
    socket timeout and is retried ``retries`` times, each on a new connection, then the command fails as
    Unavailable. The defaults are the documented 5 s and 3 retries."""
    import time
    from urllib.parse import urlsplit

    from tcp_proxy import DelayProxy

    from specserve.runtime.store import REDIS_RETRIES, REDIS_TIMEOUT_S

    default = SessionStore.from_url(redis_url)
    kwargs = default.redis.connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (REDIS_TIMEOUT_S, REDIS_TIMEOUT_S) == (5.0, 5.0)
    assert default.redis.get_retry().get_retries() == REDIS_RETRIES == 3
    await default.close()

    upstream = urlsplit(redis_url)
    link = await DelayProxy(upstream.hostname, upstream.port).start()
    store = SessionStore.from_url(f"redis://{link.address}/0", timeout_s=0.5, retries=2)
    try:
        s = sid()
        await store.create(s, (1, 2), SamplingParams(temperature=0.0), StopConditions(max_new_tokens=4))
        link.freeze()
        connections = link.connections
        start = time.perf_counter()
        with pytest.raises(Unavailable) as info:
            await store.load(s)
        elapsed = time.perf_counter() - start
        assert info.value.message == "Redis is unavailable: TimeoutError"
        assert link.connections - connections == 2, "each retry on a new connection"
        assert elapsed >= 3 * 0.5, "every attempt waited its timeout"
    finally:
        await link.stop()
        await store.close()
