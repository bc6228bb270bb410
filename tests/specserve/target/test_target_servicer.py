"""specserve.target.servicer over real gRPC on 127.0.0.1: precise status codes, sessions left intact, retries.

A real target server (tiny Llama, float32) on a free port with max_gamma = 4,
max_batch_size = 3 and a 16 KiB message limit, and a real Redis.
"""

from __future__ import annotations

import math
import struct

import grpc
import pytest
import torch
from target_helpers import greedy_continuation, new_session, next_probs

from specserve.api.params import SamplingParams
from specserve.core.proposal import draft_probs_to_pb
from specserve.runtime.config import TargetSettings
from specserve.target.server import start_target
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11)
SAMPLED = SamplingParams(temperature=1.0, seed=42)
MAX_MESSAGE_BYTES = 16 * 1024


@pytest.fixture
async def target_app(llama_target, store):
    settings = TargetSettings(
        host="127.0.0.1",
        port=0,
        max_gamma=4,
        max_batch_size=3,
        max_message_bytes=MAX_MESSAGE_BYTES,
        warmup=False,
    )
    app = await start_target(settings, model=llama_target, store=store)
    yield app
    await app.stop(grace=1.0)


@pytest.fixture
async def stub(target_app):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{target_app.port}") as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


def verify_item(record, tokens=(), distributions=(), version=None, committed_len=None):
    return target_pb2.VerifyItem(
        base=common_pb2.SessionBase(
            session_id=record.session_id,
            committed_len=record.committed_len if committed_len is None else committed_len,
            version=record.version if version is None else version,
        ),
        proposal=common_pb2.Proposal(token_ids=list(tokens), distributions=list(distributions)),
    )


def dense(values) -> common_pb2.DraftDistribution:
    raw = struct.pack(f"<{len(values)}f", *values)
    return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))


def uniform_dist(vocab_size: int) -> common_pb2.DraftDistribution:
    return dense([1.0 / vocab_size] * vocab_size)


async def expect_status(stub, request, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Verify(request)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


async def test_a_malformed_item_fails_alone_and_its_batch_mate_is_verified_as_if_it_were_absent(
    target_app, stub, store
):
    """Each malformed item gets INVALID_ARGUMENT for itself, naming what is wrong; nothing is committed for
    its session; the good item riding along commits exactly the verdict a twin session gets alone; and
    afterwards a good request on the refused session still works."""
    vocab = target_app.model.vocab_size
    record = await new_session(store, PROMPT, SAMPLED)
    nan = [1.0 / vocab] * vocab
    nan[3] = math.nan
    negative = [1.0 / (vocab - 2)] * vocab
    negative[3], negative[4] = -0.5, 0.5
    zero_at_token = [1.0 / (vocab - 1)] * vocab
    zero_at_token[7] = 0.0
    duplicate = common_pb2.DraftDistribution(
        sparse=common_pb2.SparseDistribution(token_ids=[1, 1], probs=[0.5, 0.5])
    )
    cases = {
        "token id out of range": (verify_item(record, (vocab,)), "out of range"),
        "gamma above max_gamma": (verify_item(record, (1, 2, 3, 4, 5)), "at most 4"),
        "NaN in a draft distribution": (verify_item(record, (1,), (dense(nan),)), "NaN"),
        "negative draft mass": (verify_item(record, (1,), (dense(negative),)), "negative"),
        "q = 0 at the proposed token": (verify_item(record, (7,), (dense(zero_at_token),)), "probability 0"),
        "dense vector of the wrong size": (verify_item(record, (1,), (dense([1.0]),)), "bytes"),
        "distribution count != token count": (verify_item(record, (1, 2), (uniform_dist(vocab),)), "one per"),
        "sparse support with a duplicate id": (verify_item(record, (1,), (duplicate,)), "distinct"),
        "no base": (target_pb2.VerifyItem(), "base"),
        "top_logprobs above 20": (
            target_pb2.VerifyItem(
                base=verify_item(record).base, logprobs=common_pb2.LogprobsParams(top_logprobs=21)
            ),
            "top_logprobs must be in [0, 20]",
        ),
        "an over-long session id": (verify_item(record), "at most 128"),
        "decode_steps above the limit": (verify_item(record), "at most 16 per call"),
        "an over-long cache scope": (verify_item(record), "cache_scope has 65 bytes"),
    }
    cases["an over-long cache scope"][0].cache_scope = b"s" * 65
    cases["decode_steps above the limit"][0].decode_steps = 17
    cases["an over-long session id"][0].base.session_id = "x" * 129
    for name, (bad, needle) in cases.items():
        mate, twin = await new_session(store, PROMPT, SAMPLED), await new_session(store, PROMPT, SAMPLED)
        reply = await stub.Verify(target_pb2.VerifyRequest(items=[bad, verify_item(mate, (1, 2))]))
        refused, verified = reply.results
        assert refused.WhichOneof("outcome") == "error", name
        assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], name
        assert needle in refused.error.message, (name, refused.error.message)
        alone = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(twin, (1, 2))]))
        assert verified.WhichOneof("outcome") == "verdict", name
        assert verified.verdict == alone.results[0].verdict, name
    # The same session twice: the first item is verified, the second refused.
    mate = await new_session(store, PROMPT, SAMPLED)
    reply = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(mate), verify_item(mate, (1,))]))
    assert [r.WhichOneof("outcome") for r in reply.results] == ["verdict", "error"]
    assert "twice" in reply.results[1].error.message
    assert await store.read_tokens(record.session_id) == PROMPT, "a refused item committed something"
    assert (await store.load(record.session_id)).version == 0
    reply = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(record, (1,))]))
    assert reply.results[0].verdict.new_version == 1


async def test_requests_wrong_as_a_whole_fail_whole_with_precise_statuses(target_app, stub, store):
    """No items: INVALID_ARGUMENT; more items than max_batch_size or bytes than max_message_bytes:
    RESOURCE_EXHAUSTED; nothing is committed for any item, and the sessions still work afterwards."""
    record = await new_session(store, PROMPT, SAMPLED)
    bystander = await new_session(store, PROMPT, SAMPLED)
    ok = verify_item(bystander, (1,), (uniform_dist(target_app.model.vocab_size),))
    cases = {
        "empty request": ([], grpc.StatusCode.INVALID_ARGUMENT),
        "more items than max_batch_size": (
            [verify_item(record), ok, verify_item(await new_session(store, PROMPT)), verify_item(record)],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        "message over max_message_bytes": (
            [verify_item(record, (1,), (dense([0.0] * (MAX_MESSAGE_BYTES // 4)),)), ok],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    }
    for name, (items, code) in cases.items():
        details = await expect_status(stub, target_pb2.VerifyRequest(items=items), code)
        assert details, name
    for rec in (record, bystander):
        assert await store.read_tokens(rec.session_id) == PROMPT, "a refused call committed something"
        assert (await store.load(rec.session_id)).version == 0
    reply = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(record, (1,)), ok]))
    assert [r.WhichOneof("outcome") for r in reply.results] == ["verdict", "verdict"]
    assert reply.results[0].verdict.new_version == 1


async def test_per_item_state_errors_carry_their_codes(target_app, stub, store):
    """Unknown session -> NOT_FOUND, base version that does not match -> ABORTED, base length that does not
    match -> FAILED_PRECONDITION, as per-item errors; the good item commits; the refused session still works."""
    record = await new_session(store, PROMPT)
    good = await new_session(store, PROMPT)
    ghost = verify_item(record)
    ghost.base.session_id = "never-created"
    request = target_pb2.VerifyRequest(
        items=[ghost, verify_item(record, (1,), version=5), verify_item(good, (2,))]
    )
    reply = await stub.Verify(request)
    errors = [r.error.code if r.WhichOneof("outcome") == "error" else None for r in reply.results]
    assert errors == [grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.ABORTED.value[0], None]
    assert reply.results[0].session_id == "never-created"
    assert reply.results[2].verdict.new_version == 1
    reply = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(record, committed_len=3)]))
    assert reply.results[0].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert await store.read_tokens(record.session_id) == PROMPT
    reply = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(record, (1,))]))
    assert reply.results[0].verdict.committed_len > len(PROMPT)


async def test_retried_verify_replays_the_recorded_verdict(target_app, stub, store):
    """The same Verify sent twice returns the same verdict, ``replayed`` on the second, and the log grows once."""
    model = target_app.model
    record = await new_session(store, PROMPT, SAMPLED)
    seq, tokens, rows = list(PROMPT), [], []
    for _ in range(3):
        q = next_probs(model, seq, SamplingParams(temperature=1.3))  # a draft-like q different from p
        token = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(len(seq))))
        tokens.append(token)
        rows.append(q)
        seq.append(token)
    dists = draft_probs_to_pb(torch.stack(rows).float(), sparse=False)
    item = verify_item(record, tokens, dists)
    item.logprobs.top_logprobs = 3
    request = target_pb2.VerifyRequest(items=[item])
    first = await stub.Verify(request)
    second = await stub.Verify(request)
    assert not first.results[0].replayed and second.results[0].replayed
    assert first.results[0].verdict == second.results[0].verdict, "logprobs included, bit for bit"
    verdict = first.results[0].verdict
    assert [e.token_id for e in verdict.logprobs] == list(verdict.committed_token_ids)
    assert all(len(e.top_logprobs) == 3 for e in verdict.logprobs)
    assert first.positions_processed >= 4 and second.positions_processed == 0
    assert first.verify_ns >= first.forward_ns > 0
    assert await store.read_tokens(record.session_id) == PROMPT + tuple(
        first.results[0].verdict.committed_token_ids
    )
    assert (await store.load(record.session_id)).version == 1


async def test_health_serving_then_not_serving_after_stop(target_app):
    """The server reports SERVING for the TargetService on the standard health service, NOT_SERVING once stopped."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specserve.target.server import SERVICE_NAME

    assert SERVICE_NAME == "specserve.v1.TargetService"
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{target_app.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
        await target_app.running.stop(grace=0.5)
        with pytest.raises(grpc.aio.AioRpcError):
            await health.Check(request, timeout=2)  # stopped: the server no longer answers


async def test_info_release_and_rebuild(target_app, stub, store):
    """GetTargetInfo reports the model and limits; a released session is NOT_FOUND to release again and is
    rebuilt from Redis by the next Verify, which continues target-only greedy decoding."""
    info = await stub.GetTargetInfo(target_pb2.GetTargetInfoRequest())
    model = target_app.model
    assert (info.model.vocab_size, info.model.vocab_fingerprint) == (
        model.vocab_size,
        model.vocab_fingerprint,
    )
    assert (info.max_gamma, info.max_batch_size, info.model.dtype) == (4, 3, "float32")
    assert len(info.verify_curve_ns) == 5 and min(info.verify_curve_ns) > 0  # measured at start-up
    assert not target_app.caches  # ... on a cache of its own, gone
    record = await new_session(store, PROMPT)
    await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(record)]))
    await stub.ReleaseTargetSession(target_pb2.ReleaseTargetSessionRequest(session_id=record.session_id))
    assert record.session_id not in target_app.caches
    with pytest.raises(grpc.aio.AioRpcError) as info_err:
        await stub.ReleaseTargetSession(target_pb2.ReleaseTargetSessionRequest(session_id=record.session_id))
    assert info_err.value.code() == grpc.StatusCode.NOT_FOUND
    record = await store.load(record.session_id)
    chain = greedy_continuation(model, record.token_ids, 3)
    reply = await stub.Verify(target_pb2.VerifyRequest(items=[verify_item(record, chain[:2])]))
    assert list(reply.results[0].verdict.committed_token_ids) == chain
    assert reply.positions_processed == len(record.token_ids) + 2  # re-prefilled from Redis
