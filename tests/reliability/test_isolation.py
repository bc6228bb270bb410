"""Isolation through the real system: one client's request never hurts another's, and every limit holds
before work is done (real gRPC servers on 127.0.0.1, the session's real Redis, tiny float32 models).

Two stacks:

* **poisoned**: a tiny GPT-2 pair whose learned position embedding is NaN at one position (target: 450,
  draft: 300). They are real models that answer NaN logits for any sequence reaching that position and
  normal ones otherwise, so a long prompt is a request that reaches the batch and has no distribution
  there, while short sessions run normally beside it.
* **clean**: the tiny Llama pair (512 positions), for the size limits and the context.

What is shown:

* 8 good sessions (greedy and sampled, fixed gamma) batched with bad ones give token for token the output
  of their solo runs; NaN-producing settings are refused naming the parameter; the request that turns NaN
  inside a Verify batch fails alone with INVALID_ARGUMENT, while its batch-mates in that very call commit;
  the draft's breaker stays closed.
* After a request the draft refuses (NaN on the draft only), the next healthy request gets proposals.
* An 8 MB text prompt is refused within 1 s, and a concurrent small request takes under 2x its solo time
  (medians of three, side by side in one run); a long prompt is tokenized off the event loop: health checks
  keep answering meanwhile. Over-long stop lists are refused, a 600k-entry list within 1 s.
* A prompt that fits but runs into the context ends with ``length`` at the context, equal to the target's
  own ``generate()``; a prompt that fills the context is refused before any token and creates no session.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_helpers import Stream
from waiting import wait_until

from specserve.v1 import common_pb2, coordinator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

TARGET_NAN_AT = 450
DRAFT_NAN_AT = 300
TEXTS = ("class Point:\n    def", "for i in range(", "def add(a, b):", "import os\nimport")


def long_prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 380 + 1 for i in range(n)]


# --------------------------------------------------------------------------- stacks


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    pair = sf.tiny_pair(tmp_path_factory, arch="gpt2")
    root = tmp_path_factory.mktemp("poisoned")
    return sf.TinyPair(
        sf.poisoned_copy(pair.target_dir, root / "target", position=TARGET_NAN_AT),
        sf.poisoned_copy(pair.draft_dir, root / "draft", position=DRAFT_NAN_AT),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def poisoned_stack(poisoned, redis_server):
    # A batch waits for the sessions bound to its replica (up to 1 s): the bad item joins the good ones even
    # when their proposals come late from a draft slowed by the bad item's own refusal.
    overrides = {"max_batch_wait_ms": 1000.0, "draft_backoff_s": 30.0, "draft_max_backoff_s": 60.0}
    async with sf.local_stack(poisoned, redis_server.url, coordinator_overrides=overrides) as stack:
        yield stack


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clean_stack(clean, redis_server):
    overrides = {"max_prompt_bytes": 4_000_000, "max_prompt_tokens": 100_000}
    async with sf.local_stack(clean, redis_server.url, coordinator_overrides=overrides) as stack:
        yield stack


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    from specserve.runtime.store import SessionStore

    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()


def goods(tokenizer) -> list[coordinator_pb2.GenerateRequest]:
    """8 good requests: greedy and sampled, fixed gamma (a sampled text depends on the speculation schedule)."""
    out = []
    for i in range(8):
        prompt = tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False)
        sampled = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {}
        out.append(sf.request(prompt, max_new_tokens=32, gamma=2, ignore_eos=True, **sampled))
    return out


def with_sampling(req: coordinator_pb2.GenerateRequest, **fields) -> coordinator_pb2.GenerateRequest:
    copy = coordinator_pb2.GenerateRequest()
    copy.CopyFrom(req)
    for name, value in fields.items():
        setattr(copy.sampling, name, value)
    return copy


class BatchRecorder:
    """Records, for every Verify call the target serves, each item's session and whether it committed
    (a spy on the real verifier's ``verify``)."""

    def __init__(self, verifier) -> None:
        self.calls: list[list[tuple[str, str | None]]] = []
        self._verifier, self._inner = verifier, verifier.verify

        async def verify(batch):
            result = await self._inner(batch)
            self.calls.append([(r.session_id, type(r.error).__name__ if r.error else None) for r in result.results])
            return result

        verifier.verify = verify

    def close(self) -> None:
        self._verifier.verify = self._inner


# --------------------------------------------------------------------------- one bad request, eight good ones


async def test_bad_requests_batched_with_eight_good_ones_fail_alone(poisoned_stack, poisoned):
    stack = poisoned_stack
    requests = goods(poisoned.tokenizer)
    for r in requests:  # long enough to still be running when the bad ones arrive, on a loaded machine too
        r.stop.max_new_tokens = 160
    solo = [await Stream(r).run(stack.address) for r in requests]
    assert all(s.ok for s in solo), [s.details for s in solo]
    assert all(s.stats.proposed_tokens > 0 for s in solo)

    nan_in_batch = sf.request(long_prompt(TARGET_NAN_AT + 10), max_new_tokens=8, gamma=2, ignore_eos=True)
    tiny_temperature = with_sampling(requests[1], temperature=1e-40)
    tiny_penalty = with_sampling(requests[1], repetition_penalty=1e-40)
    recorder = BatchRecorder(stack.targets[0].verifier)
    try:
        streams = [Stream(r) for r in requests]
        tasks = [asyncio.create_task(s.run(stack.address)) for s in streams]
        await wait_until(lambda: all(s.tokens or s.done for s in streams), timeout_s=60, what="first tokens")
        bads = [Stream(r) for r in (nan_in_batch, tiny_temperature, tiny_penalty)]
        await asyncio.gather(*tasks, *(b.run(stack.address) for b in bads))
    finally:
        recorder.close()

    for alone, together in zip(solo, streams, strict=True):
        assert together.ok, together.details
        assert together.tokens == alone.tokens, "a good session's output changed next to bad ones"
    nan, temperature, penalty = bads
    assert nan.code == grpc.StatusCode.INVALID_ARGUMENT and not nan.tokens
    assert "NaN or infinite" in nan.details and "temperature" in nan.details, nan.details
    assert temperature.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature=" in temperature.details and "is too small" in temperature.details
    assert penalty.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "repetition_penalty must be in" in penalty.details
    # The NaN row was refused inside a Verify call whose other items committed.
    shared = [c for c in recorder.calls if any(e == "InvalidDistribution" for _, e in c) and any(e is None for _, e in c)]
    assert shared, f"the bad item never shared a batch: {recorder.calls}"
    draft = stack.coordinator.coordinator.pool.drafts
    assert all(draft.failures(ep) == 0 for ep in draft.endpoints)


async def test_after_a_request_the_draft_refuses_the_next_one_still_gets_proposals(poisoned_stack):
    stack = poisoned_stack
    refused_by_draft = sf.request(long_prompt(DRAFT_NAN_AT + 50), max_new_tokens=4, gamma=2, ignore_eos=True)
    bad = await Stream(refused_by_draft).run(stack.address)
    assert bad.ok, bad.details  # the target alone decides every token: the session itself is fine
    assert bad.stats.proposed_tokens == 0  # the draft refused every round of it (its own NaN)
    healthy = await Stream(sf.request([5, 6, 7, 8], max_new_tokens=6, gamma=2, ignore_eos=True)).run(stack.address)
    assert healthy.ok and healthy.stats.proposed_tokens > 0
    draft = stack.coordinator.coordinator.pool.drafts
    assert all(draft.is_up(ep) and draft.failures(ep) == 0 for ep in draft.endpoints)


# --------------------------------------------------------------------------- limits before work


async def _timed(address: str, req) -> tuple[float, Stream]:
    start = time.perf_counter()
    stream = await Stream(req).run(address)
    return time.perf_counter() - start, stream


async def test_an_8_mb_prompt_is_refused_at_once_and_a_concurrent_session_is_not_slowed(clean_stack, clean):
    address = clean_stack.address
    small = sf.request(clean.tokenizer.encode(TEXTS[0], add_special_tokens=False), max_new_tokens=32, gamma=2)
    huge = sf.request("x" * 8_000_000, max_new_tokens=8)
    await _timed(address, small)  # warm
    solo, together, refusals = [], [], []
    for _ in range(3):
        solo.append((await _timed(address, small))[0])
        (t_small, s), (t_huge, h) = await asyncio.gather(_timed(address, small), _timed(address, huge))
        assert s.ok and h.code == grpc.StatusCode.INVALID_ARGUMENT, h.details
        assert "the prompt text is 8000000 bytes" in h.details
        together.append(t_small)
        refusals.append(t_huge)
    assert max(refusals) < 1.0, refusals
    assert statistics.median(together) < 2 * statistics.median(solo), (solo, together)


async def test_a_long_prompt_is_tokenized_off_the_event_loop(clean_stack, clean):
    """While a 2 MB prompt is tokenized (then refused for its token count), health checks on the same
    coordinator keep answering: on the event loop they would wait for the whole tokenization."""
    text = ("def add(a, b):\n    return a + b\n" * 70_000)[:2_000_000]
    start = time.perf_counter()
    clean.tokenizer.encode(text, add_special_tokens=False)
    tokenize_s = time.perf_counter() - start
    assert tokenize_s > 0.5, f"the prompt tokenizes in {tokenize_s:.2f} s, too fast to show anything"
    latencies: list[float] = []

    async def probe(channel, until: asyncio.Task) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        while not until.done():
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)

    async with grpc.aio.insecure_channel(clean_stack.address) as channel:
        big = asyncio.create_task(Stream(sf.request(text, max_new_tokens=8)).run(clean_stack.address))
        await probe(channel, big)
        refused = await big
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "limit of 100000" in refused.details
    assert len(latencies) >= 3
    assert max(latencies) < max(0.25, tokenize_s / 4), (tokenize_s, latencies)


async def test_over_long_stop_lists_are_refused_before_any_work(clean_stack):
    address = clean_stack.address
    cases = {
        "17 stop strings": (dict(stop_strings=[f"s{i}" for i in range(17)]), "at most 16"),
        "a 129-character stop string": (dict(stop_strings=["x" * 129]), "at most 128 per stop string"),
        "600k stop strings": (dict(stop_strings=[f"{i:x}" for i in range(600_000)]), "at most 16"),
    }
    for name, (kwargs, needle) in cases.items():
        elapsed, out = await _timed(address, sf.request([5, 6, 7], max_new_tokens=4, **kwargs))
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT and needle in out.details, (name, out.details)
        assert elapsed < 1.0, (name, elapsed)
    ids = sf.request([5, 6, 7], max_new_tokens=4)
    ids.stop.stop_token_ids.extend(range(1, 66))
    out = await Stream(ids).run(address)
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT and "at most 64" in out.details
    ok = await Stream(sf.request([5, 6, 7], max_new_tokens=4, stop_strings=["s"] * 16)).run(address)
    assert ok.ok


# --------------------------------------------------------------------------- the context


async def test_a_prompt_that_runs_into_the_context_ends_with_length_there(clean_stack, clean, store):
    """Context 512: a 500-token prompt asking for 64 tokens gets 12, the target's own greedy ones, and
    finishes with `length`; the log holds exactly 512 tokens."""
    prompt = long_prompt(500)
    out = await Stream(sf.request(prompt, max_new_tokens=64, gamma=3, ignore_eos=True)).run(clean_stack.address)
    assert out.ok, out.details
    assert out.stats.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert out.tokens == sf.reference_greedy(clean.target_dir, prompt, 12, ignore_eos=True)
    assert len((await store.load(out.session_id)).token_ids) == 512


async def test_a_prompt_that_fills_the_context_is_refused_before_any_token(clean_stack, store):
    before = len(await store.session_ids())
    for n in (512, 600):
        out = await Stream(sf.request(long_prompt(n), max_new_tokens=4)).run(clean_stack.address)
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT and not out.tokens and out.stats is None
        assert f"the prompt has {n} tokens but the model's context holds 512" in out.details
    after = len(await store.session_ids())
    assert after == before, "a refused request created a session"
    one = await Stream(sf.request(long_prompt(511), max_new_tokens=4, ignore_eos=True)).run(clean_stack.address)
    assert one.ok and len(one.tokens) == 1 and one.stats.finish_reason == common_pb2.FINISH_REASON_LENGTH
