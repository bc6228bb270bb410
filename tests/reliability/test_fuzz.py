"""Bad input, property-based: malformed and extreme messages to each service never get a bug status.

One real stack (target, draft, coordinator; tiny float32 Llama pair) runs on a
loop in a background thread (hypothesis drives synchronous tests) against the
session's real Redis. For each service hypothesis draws requests mixing
well-formed parts with malformed and extreme ones: random and huge token ids,
huge gamma, NaN / infinite / negative / unnormalised probabilities, dense
bytes of the wrong length, sparse supports with bad ids, unknown session ids,
wrong versions and lengths, oversize prompts, empty fields, unknown enum
values, and random bytes as the raw request body. Each call must end OK or with
a status that names the caller's mistake (:data:`CLEAN_CODES`: never INTERNAL or
UNKNOWN, which mean a bug escaped), and afterwards each service must still
answer a well-formed request *correctly* (greedy output equal to the model's own
``generate()``).

Bounded: ``max_examples`` per test below, no per-example deadline, no example
database written.
"""

from __future__ import annotations

import struct
import uuid

import grpc
import numpy as np
import pytest
import system_fixtures as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import CLEAN_CODES, LoopThread

from specserve.params import SamplingParams, StopConditions
from specserve.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

VOCAB = 384
MAX_NEW_LIMIT = 8  # the coordinator's max_new_tokens_limit: valid generations stay short
MAX_PROMPT = 48  # the coordinator's max_prompt_tokens
KNOWN = "@known"  # placeholder for a real session created in Redis for the example

FUZZ = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
ENUM = st.one_of(st.integers(-3, 4), st.integers(-(2**31), 2**31 - 1))
FLOAT = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.4e38]),
    st.floats(width=32),
)
TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), U32)
TOKENS = st.lists(TOKEN, max_size=24)


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=draw(st.one_of(st.sampled_from([0.0, 0.7, 1.0]), FLOAT)),
        top_k=draw(st.one_of(st.just(0), st.integers(1, VOCAB + 2), U32)),
        min_p=draw(st.one_of(st.just(0.0), FLOAT)),
    )
    if draw(st.booleans()):
        pb.top_p = draw(st.one_of(st.sampled_from([0.9, 1.0]), FLOAT))
    if draw(st.booleans()):
        pb.repetition_penalty = draw(st.one_of(st.sampled_from([1.0, 1.3]), FLOAT))
    if draw(st.booleans()):
        pb.seed = draw(U64)
    return pb


def _dense_bytes(kind: str, seed: int, token: int) -> bytes:
    """A dense row of VOCAB float32 values: a good distribution or one broken in one way."""
    rng = np.random.default_rng(seed)
    row = rng.random(VOCAB).astype(np.float64) + 1e-3
    row /= row.sum()
    if kind == "nan":
        row[rng.integers(VOCAB)] = np.nan
    elif kind == "negative":
        row[rng.integers(VOCAB)] = -0.5
    elif kind == "unnormalised":
        row *= 3.0
    elif kind == "zero_at_token":
        row[token % VOCAB] = 0.0
        row /= row.sum()
    elif kind == "inf":
        row[0] = np.inf
    return row.astype("<f4").tobytes()


@st.composite
def distribution(draw, token: int) -> common_pb2.DraftDistribution:
    kind = draw(
        st.sampled_from(
            [
                "good",
                "good",
                "nan",
                "negative",
                "unnormalised",
                "zero_at_token",
                "inf",
                "bytes",
                "sparse",
                "empty",
            ]
        )
    )
    if kind == "bytes":  # wrong length, or random content of the right length
        raw = draw(st.one_of(st.binary(max_size=64), st.binary(min_size=4 * VOCAB, max_size=4 * VOCAB)))
        return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))
    if kind == "sparse":
        ids = draw(st.lists(TOKEN, max_size=6))
        probs = draw(
            st.lists(
                st.one_of(st.just(1.0 / max(len(ids), 1)), FLOAT),
                min_size=len(ids),
                max_size=len(ids) + draw(st.integers(0, 1)),
            )
        )
        return common_pb2.DraftDistribution(sparse=common_pb2.SparseDistribution(token_ids=ids, probs=probs))
    if kind == "empty":  # neither support set
        return common_pb2.DraftDistribution()
    raw = _dense_bytes(kind, draw(st.integers(0, 2**16)), token)
    return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))


@st.composite
def verify_item_plan(draw) -> dict:
    """A VerifyItem with placeholders (KNOWN, None = the known session's current value)."""
    sid = draw(st.sampled_from([KNOWN, KNOWN, KNOWN, "", "no-such-session"]) | st.text(max_size=20))
    committed_len = draw(st.sampled_from([None, None, 0]) | U32)
    version = draw(st.sampled_from([None, None, 0, 1]) | U64)
    tokens = draw(st.one_of(TOKENS, st.lists(st.integers(0, VOCAB - 1), min_size=17, max_size=40)))
    mode = draw(st.sampled_from(["none", "per_token", "per_token", "count_mismatch"]))
    if mode == "none":
        dists = []
    elif mode == "per_token":
        dists = [draw(distribution(t)) for t in tokens]
    else:
        dists = [
            draw(distribution(0))
            for _ in range(len(tokens) + draw(st.sampled_from([-1, 1, 2])) if tokens else 1)
        ]
    return {
        "sid": sid,
        "committed_len": committed_len,
        "version": version,
        "tokens": tokens,
        "dists": dists,
        "has_base": draw(st.booleans()) or sid == KNOWN,
    }


@st.composite
def verify_plan(draw) -> dict:
    greedy = draw(st.booleans())
    items = draw(st.lists(verify_item_plan(), max_size=3))
    if draw(st.integers(0, 19)) == 0:
        items = items * 20  # more items than max_batch_size (and duplicate sessions)
    return {"greedy": greedy, "items": items}


@st.composite
def propose_plan(draw) -> dict:
    tokens = draw(st.one_of(TOKENS, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)))
    start = draw(st.sampled_from([0, 0, 0, 1]) | U32)
    consistent = draw(st.booleans())
    return {
        "sid": draw(st.sampled_from(["fresh", "fresh", "", "known-to-none"]) | st.text(max_size=20)),
        "start": start,
        "tokens": tokens,
        "committed_len": start + len(tokens) if consistent and start + len(tokens) < 2**32 else draw(U32),
        "version": draw(st.sampled_from([0, 1]) | U64),
        "gamma": draw(st.one_of(st.integers(0, 6), st.integers(17, 64), U32)),
        "proposer": draw(ENUM),
        "draft_top_k": draw(st.one_of(st.just(0), st.integers(1, VOCAB + 1), U32)),
        "seed": draw(U64),
        "sampling": draw(sampling()),
        "has_base": draw(st.integers(0, 9)) > 0,
    }


@st.composite
def generate_plan(draw) -> coordinator_pb2.GenerateRequest:
    req = coordinator_pb2.GenerateRequest(sampling=draw(sampling()))
    prompt = draw(st.sampled_from(["text", "tokens", "tokens", "none"]))
    if prompt == "text":
        req.text = draw(st.text(max_size=80))
    elif prompt == "tokens":
        req.tokens.token_ids.extend(
            draw(
                st.one_of(
                    TOKENS,
                    st.lists(st.integers(0, VOCAB - 1), min_size=MAX_PROMPT + 1, max_size=MAX_PROMPT + 40),
                )
            )
        )
        if not req.tokens.token_ids and draw(st.booleans()):
            req.tokens.SetInParent()  # an empty but present prompt
    req.stop.max_new_tokens = draw(st.one_of(st.integers(0, MAX_NEW_LIMIT), U32))
    req.stop.stop_token_ids.extend(draw(st.lists(TOKEN, max_size=3)))
    req.stop.stop_strings.extend(draw(st.lists(st.text(max_size=4), max_size=3)))
    req.stop.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.speculation.gamma = draw(st.one_of(st.integers(0, 8), U32))
    req.speculation.proposer = draw(ENUM)
    req.speculation.draft_top_k = draw(st.one_of(st.just(0), st.integers(1, VOCAB + 1), U32))
    return req


# --------------------------------------------------------------------------- the stack


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def fuzz_stack(pair, redis_server):
    """(loop thread, LocalStack, SessionStore) for the whole module."""
    from specserve.local import start_local_stack
    from specserve.store import SessionStore

    loop = LoopThread()
    no_warmup = {"warmup": False}

    async def start():
        stack = await start_local_stack(
            target_model=pair.target_dir,
            draft_model=pair.draft_dir,
            redis_url=redis_server.url,
            device="cpu",
            dtype="float32",
            target_overrides=no_warmup,
            draft_overrides=no_warmup,
            coordinator_overrides={
                "max_new_tokens_limit": MAX_NEW_LIMIT,
                "default_max_new_tokens": MAX_NEW_LIMIT,
                "max_prompt_tokens": MAX_PROMPT,
            },
        )
        return stack, SessionStore.from_url(redis_server.url, ttl_s=600)

    stack, store = loop.run(start(), timeout_s=300)
    yield loop, stack, store

    async def stop():
        await stack.stop(grace=0.5)
        await store.close()

    loop.run(stop(), timeout_s=60)
    loop.close()


@pytest.fixture(scope="module")
def channels(fuzz_stack):
    _, stack, _ = fuzz_stack
    opened = {
        "target": grpc.insecure_channel(f"127.0.0.1:{stack.target_ports[0]}"),
        "draft": grpc.insecure_channel(f"127.0.0.1:{stack.draft_port}"),
        "coordinator": grpc.insecure_channel(stack.address),
    }
    yield opened
    for channel in opened.values():
        channel.close()


def _code(fn) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _assert_clean(code: grpc.StatusCode, details: str, request) -> None:
    assert code in CLEAN_CODES, f"{code.name}: {details}\nrequest: {str(request)[:2000]}"


PROMPT = (5, 17, 42, 99, 3, 250, 7, 11)


def _new_session(fuzz_stack, *, greedy: bool, prompt=PROMPT) -> str:
    loop, _, store = fuzz_stack
    sid = f"fuzz-{uuid.uuid4().hex}"
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, seed=7)
    loop.run(store.create(sid, prompt, params, StopConditions(max_new_tokens=64, ignore_eos=True)))
    return sid


# --------------------------------------------------------------------------- target Verify


@FUZZ
@given(plan=verify_plan())
def test_target_verify_survives_bad_input(fuzz_stack, channels, plan):
    loop, _, store = fuzz_stack
    stub = target_pb2_grpc.TargetServiceStub(channels["target"])
    known = _new_session(fuzz_stack, greedy=plan["greedy"]) if plan["items"] else None
    record = loop.run(store.load(known)) if known else None
    request = target_pb2.VerifyRequest()
    for it in plan["items"]:
        item = request.items.add()
        if it["has_base"]:
            item.base.session_id = known if it["sid"] == KNOWN else it["sid"]
            item.base.committed_len = (
                record.committed_len if it["committed_len"] is None else it["committed_len"]
            )
            item.base.version = record.version if it["version"] is None else it["version"]
        item.proposal.token_ids.extend(it["tokens"])
        item.proposal.distributions.extend(it["dists"])
    code, details = _code(lambda: stub.Verify(request, timeout=60))
    _assert_clean(code, details, request)
    if known is not None:  # whatever happened, the log is a well-formed extension of the prompt
        after = loop.run(store.load(known))
        assert after.token_ids[: len(PROMPT)] == PROMPT
        assert after.version in (0, 1) and (after.version == 1) == (after.committed_len > len(PROMPT))


def test_target_still_verifies_correctly(fuzz_stack, channels, pair):
    """After the fuzzing: the target's own greedy continuation is accepted whole, plus the right bonus."""
    loop, _, store = fuzz_stack
    expected = sf.reference_greedy(pair.target_dir, PROMPT, 5, ignore_eos=True)
    sid = _new_session(fuzz_stack, greedy=True)
    request = target_pb2.VerifyRequest(
        items=[
            target_pb2.VerifyItem(
                base=common_pb2.SessionBase(session_id=sid, committed_len=len(PROMPT), version=0),
                proposal=common_pb2.Proposal(token_ids=expected[:4]),
            )
        ]
    )
    reply = target_pb2_grpc.TargetServiceStub(channels["target"]).Verify(request, timeout=60)
    verdict = reply.results[0].verdict
    assert list(verdict.committed_token_ids) == expected and verdict.accepted_count == 4 and verdict.bonus
    assert loop.run(store.load(sid)).generated_token_ids == tuple(expected)


# --------------------------------------------------------------------------- draft Propose


@FUZZ
@given(plan=propose_plan())
def test_draft_propose_survives_bad_input(channels, plan):
    stub = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    request = draft_pb2.ProposeRequest(
        start_position=plan["start"],
        token_ids=plan["tokens"],
        sampling=plan["sampling"],
        gamma=plan["gamma"],
        proposer=plan["proposer"],
        draft_top_k=plan["draft_top_k"],
        seed=plan["seed"],
    )
    if plan["has_base"]:
        sid = f"fuzz-{uuid.uuid4().hex}" if plan["sid"] == "fresh" else plan["sid"]
        request.base.CopyFrom(
            common_pb2.SessionBase(
                session_id=sid, committed_len=plan["committed_len"], version=plan["version"]
            )
        )
    code, details = _code(lambda: stub.Propose(request, timeout=60))
    _assert_clean(code, details, request)


def test_draft_still_proposes_correctly(channels, pair):
    """After the fuzzing: a greedy proposal equals the draft model's own greedy continuation."""
    gamma = 5
    expected = sf.reference_greedy(pair.draft_dir, PROMPT, gamma, ignore_eos=True)
    request = draft_pb2.ProposeRequest(
        base=common_pb2.SessionBase(session_id=f"fuzz-{uuid.uuid4().hex}", committed_len=len(PROMPT)),
        start_position=0,
        token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        gamma=gamma,
        proposer=common_pb2.PROPOSER_KIND_MODEL,
    )
    reply = draft_pb2_grpc.DraftServiceStub(channels["draft"]).Propose(request, timeout=60)
    assert list(reply.proposal.token_ids) == expected


# --------------------------------------------------------------------------- coordinator Generate


@FUZZ
@given(request=generate_plan())
def test_coordinator_generate_survives_bad_input(channels, request):
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channels["coordinator"])
    received: list[int] = []

    def run():
        for reply in stub.Generate(request, timeout=60):
            if reply.WhichOneof("event") == "chunk":
                received.extend(reply.chunk.token_ids)

    code, details = _code(run)
    _assert_clean(code, details, request)
    if code == grpc.StatusCode.OK:
        assert len(received) <= MAX_NEW_LIMIT
        assert all(0 <= t < VOCAB for t in received)


def test_coordinator_still_generates_correctly(channels, pair):
    """After the fuzzing: a greedy generation equals the target's own generate()."""
    expected = sf.reference_greedy(pair.target_dir, PROMPT, MAX_NEW_LIMIT, ignore_eos=True)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channels["coordinator"])
    received = [
        t
        for reply in stub.Generate(
            sf.request(PROMPT, max_new_tokens=MAX_NEW_LIMIT, ignore_eos=True), timeout=60
        )
        if reply.WhichOneof("event") == "chunk"
        for t in reply.chunk.token_ids
    ]
    assert received == expected


# --------------------------------------------------------------------------- raw bytes

RAW_METHODS = [
    ("target", "/specserve.v1.TargetService/Verify", False),
    ("target", "/specserve.v1.TargetService/ReleaseTargetSession", False),
    ("draft", "/specserve.v1.DraftService/Propose", False),
    ("draft", "/specserve.v1.DraftService/ReleaseDraftSession", False),
    ("coordinator", "/specserve.v1.CoordinatorService/Generate", True),
]


@FUZZ
@given(
    which=st.sampled_from(RAW_METHODS),
    body=st.one_of(
        st.binary(max_size=256),
        st.binary(max_size=8).map(lambda b: b"\xff\xff\xff\xff" + b),  # never a valid protobuf
        st.integers(0, 2**32 - 1).map(lambda n: b"\x0a" + struct.pack("<I", n)),  # a length past the end
    ),
)
def test_random_bytes_as_the_request_body(channels, which, body):
    role, method, streaming = which
    channel = channels[role]
    if streaming:
        call = channel.unary_stream(method)
        code, details = _code(lambda: list(call(body, timeout=60)))
    else:
        code, details = _code(lambda: channel.unary_unary(method)(body, timeout=60))
    _assert_clean(code, details, body)
