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

Bad requests also run *beside good ones*, where a clean status for the bad one is
not enough: bad items batched with good items in one Verify call (each good item
must commit exactly the verdict its twin gets alone), bad Proposes sent together
with a good one (which must still get the draft's own greedy continuation), and
bad Generate requests running at the same time as a good one (which must still
get the target's own output, with draft proposals, and no replica's breaker may
open).

Bounded: ``max_examples`` per test below, no per-example deadline, no example
database written.
"""

from __future__ import annotations

import asyncio
import struct
import uuid

import grpc
import numpy as np
import pytest
import system_fixtures as sf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reliability_helpers import CLEAN_CODES, LoopThread, Stream

from specserve.api.params import SamplingParams, StopConditions
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
GOOD_TOKEN = st.integers(0, VOCAB - 1)
TOKEN = st.one_of(GOOD_TOKEN, GOOD_TOKEN, U32)


def defects(draw, fields: list[str]) -> set[str]:
    """Which fields of a request to draw from their wild strategy: none (a well-formed
    request, reaching the model and Redis) in about a third of the examples, else one or two."""
    return draw(st.sets(st.sampled_from(fields), max_size=2))


def pick(draw, bad: set[str], name: str, good, wild):
    return draw(wild if name in bad else good)


@st.composite
def sampling(draw, wild: bool = False) -> common_pb2.SamplingParams:
    if not wild:
        pb = common_pb2.SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1.5])),
            top_k=draw(st.sampled_from([0, 0, 1, 5, VOCAB])),
            min_p=draw(st.sampled_from([0.0, 0.0, 0.05])),
        )
        if draw(st.booleans()):
            pb.top_p = draw(st.sampled_from([0.5, 0.9, 1.0]))
        if draw(st.booleans()):
            pb.repetition_penalty = draw(st.sampled_from([1.0, 1.3, 0.8]))
    else:
        pb = common_pb2.SamplingParams(
            temperature=draw(FLOAT),
            top_k=draw(st.one_of(st.integers(0, VOCAB + 2), U32)),
            min_p=draw(FLOAT),
        )
        if draw(st.booleans()):
            pb.top_p = draw(FLOAT)
        if draw(st.booleans()):
            pb.repetition_penalty = draw(FLOAT)
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
def distribution(draw, token: int, wild: bool) -> common_pb2.DraftDistribution:
    """The distribution shipped with ``token``: a valid dense or sparse one, or a broken one."""
    if not wild:
        if draw(st.booleans()):
            raw = _dense_bytes("good", draw(st.integers(0, 2**16)), token)
            return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))
        support = sorted({token, *draw(st.lists(GOOD_TOKEN, max_size=4))})
        probs = [1.0 / len(support)] * len(support)
        return common_pb2.DraftDistribution(
            sparse=common_pb2.SparseDistribution(token_ids=support, probs=probs)
        )
    kind = draw(
        st.sampled_from(
            ["nan", "negative", "unnormalised", "zero_at_token", "inf", "bytes", "sparse", "empty"]
        )
    )
    if kind == "bytes":  # wrong length, or random content of the right length
        raw = draw(st.one_of(st.binary(max_size=64), st.binary(min_size=4 * VOCAB, max_size=4 * VOCAB)))
        return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))
    if kind == "sparse":  # bad ids, bad or mismatched probabilities
        ids = draw(st.lists(TOKEN, max_size=6))
        probs = draw(
            st.lists(
                st.one_of(st.just(1.0 / max(len(ids), 1)), FLOAT),
                min_size=max(len(ids) - 1, 0),
                max_size=len(ids) + 1,
            )
        )
        return common_pb2.DraftDistribution(sparse=common_pb2.SparseDistribution(token_ids=ids, probs=probs))
    if kind == "empty":  # neither support set
        return common_pb2.DraftDistribution()
    raw = _dense_bytes(kind, draw(st.integers(0, 2**16)), token)
    return common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw))


VERIFY_FIELDS = ["sid", "committed_len", "version", "tokens", "dists", "dist_count", "base", "items"]


@st.composite
def verify_plan(draw) -> dict:
    """One VerifyRequest, as placeholders: KNOWN is a session created for the example,
    None its current length / version."""
    bad = defects(draw, VERIFY_FIELDS)
    tokens = pick(
        draw,
        bad,
        "tokens",
        st.lists(GOOD_TOKEN, max_size=6),
        st.one_of(st.lists(TOKEN, max_size=24), st.lists(GOOD_TOKEN, min_size=17, max_size=40)),
    )
    with_dists = "dists" in bad or draw(st.booleans())
    dists = [draw(distribution(t, wild="dists" in bad)) for t in tokens] if with_dists else []
    if "dist_count" in bad:
        dists = dists[:-1] if dists else [draw(distribution(0, wild=False))]
    item = {
        "sid": pick(
            draw, bad, "sid", st.just(KNOWN), st.sampled_from(["", "no-such-session"]) | st.text(max_size=20)
        ),
        "committed_len": pick(draw, bad, "committed_len", st.none(), st.sampled_from([0, 1]) | U32),
        "version": pick(draw, bad, "version", st.none(), st.sampled_from([1, 2]) | U64),
        "tokens": tokens,
        "dists": dists,
        "has_base": "base" not in bad,
    }
    items = [item]
    if "items" in bad:
        items = draw(st.sampled_from([[], [item, item], [item] * 40]))  # none, duplicates, too many
    return {"greedy": draw(st.booleans()), "items": items}


PROPOSE_FIELDS = [
    "sid",
    "base",
    "start",
    "tokens",
    "committed_len",
    "version",
    "gamma",
    "proposer",
    "top_k",
    "sampling",
]


@st.composite
def propose_plan(draw) -> dict:
    bad = defects(draw, PROPOSE_FIELDS)
    tokens = pick(
        draw, bad, "tokens", st.lists(GOOD_TOKEN, min_size=1, max_size=24), st.lists(TOKEN, max_size=24)
    )
    start = pick(draw, bad, "start", st.just(0), st.sampled_from([1, 5]) | U32)
    consistent = start + len(tokens)
    return {
        "sid": pick(draw, bad, "sid", st.just("fresh"), st.sampled_from([""]) | st.text(max_size=20)),
        "start": start,
        "tokens": tokens,
        "committed_len": consistent if "committed_len" not in bad and consistent < 2**32 else draw(U32),
        "version": pick(draw, bad, "version", st.just(0), U64),
        "gamma": pick(draw, bad, "gamma", st.integers(0, 8), st.one_of(st.integers(17, 64), U32)),
        "proposer": pick(draw, bad, "proposer", st.sampled_from([0, 1, 2]), ENUM),
        "draft_top_k": pick(
            draw, bad, "top_k", st.sampled_from([0, 0, 3, 50]), st.one_of(st.integers(0, VOCAB + 1), U32)
        ),
        "seed": draw(U64),
        "sampling": draw(sampling(wild="sampling" in bad)),
        "has_base": "base" not in bad,
    }


GENERATE_FIELDS = ["prompt", "sampling", "max_new", "stop_ids", "stop_strings", "gamma", "proposer", "top_k"]


@st.composite
def generate_plan(draw) -> coordinator_pb2.GenerateRequest:
    bad = defects(draw, GENERATE_FIELDS)
    req = coordinator_pb2.GenerateRequest(sampling=draw(sampling(wild="sampling" in bad)))
    if "prompt" not in bad:
        if draw(st.booleans()):
            req.text = draw(st.text(min_size=1, max_size=40).filter(str.strip))
        else:
            req.tokens.token_ids.extend(draw(st.lists(GOOD_TOKEN, min_size=1, max_size=MAX_PROMPT)))
    else:
        kind = draw(
            st.sampled_from(["none", "empty_text", "empty_tokens", "oversize", "bad_ids", "odd_text"])
        )
        if kind == "empty_text":
            req.text = ""
        elif kind == "empty_tokens":
            req.tokens.SetInParent()
        elif kind == "oversize":
            req.tokens.token_ids.extend(
                draw(st.lists(GOOD_TOKEN, min_size=MAX_PROMPT + 1, max_size=MAX_PROMPT + 60))
            )
        elif kind == "bad_ids":
            req.tokens.token_ids.extend(draw(st.lists(TOKEN, min_size=1, max_size=10)))
        elif kind == "odd_text":
            req.text = draw(st.text(max_size=200))
    req.stop.max_new_tokens = pick(draw, bad, "max_new", st.integers(0, MAX_NEW_LIMIT), U32)
    req.stop.stop_token_ids.extend(
        pick(draw, bad, "stop_ids", st.lists(GOOD_TOKEN, max_size=2), st.lists(TOKEN, max_size=4))
    )
    req.stop.stop_strings.extend(
        pick(
            draw,
            bad,
            "stop_strings",
            st.lists(st.sampled_from(["\n", "def", ")"]), max_size=2),
            st.lists(st.text(max_size=4), max_size=3),
        )
    )
    req.stop.ignore_eos = draw(st.booleans())
    if "gamma" in bad:
        req.speculation.gamma = draw(st.one_of(st.integers(9, 64), U32))
    elif draw(st.booleans()):
        req.speculation.gamma = draw(st.integers(0, 8))
    req.speculation.proposer = pick(draw, bad, "proposer", st.sampled_from([0, 1, 2]), ENUM)
    req.speculation.draft_top_k = pick(
        draw, bad, "top_k", st.sampled_from([0, 0, 3, 50]), st.one_of(st.integers(VOCAB - 1, VOCAB + 1), U32)
    )
    return req


# --------------------------------------------------------------------------- the stack


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def fuzz_stack(pair, redis_server):
    """(loop thread, LocalStack, SessionStore) for the whole module."""
    from specserve.launch.local import start_local_stack
    from specserve.runtime.store import SessionStore

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
    event(f"status {code.name}")  # shown by --hypothesis-show-statistics
    assert code in CLEAN_CODES, f"{code.name}: {details}\nrequest: {str(request)[:2000]}"


PROMPT = (5, 17, 42, 99, 3, 250, 7, 11)


def _new_session(fuzz_stack, *, greedy: bool, prompt=PROMPT) -> str:
    loop, _, store = fuzz_stack
    sid = f"fuzz-{uuid.uuid4().hex}"
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, seed=7)
    loop.run(store.create(sid, prompt, params, StopConditions(max_new_tokens=64, ignore_eos=True)))
    return sid


def _plan_item(it: dict, known: str | None, record) -> target_pb2.VerifyItem:
    """A VerifyItem from one item of a :func:`verify_plan` (KNOWN / None resolved against ``record``)."""
    item = target_pb2.VerifyItem()
    if it["has_base"]:
        item.base.session_id = known if it["sid"] == KNOWN else it["sid"]
        item.base.committed_len = record.committed_len if it["committed_len"] is None else it["committed_len"]
        item.base.version = record.version if it["version"] is None else it["version"]
    item.proposal.token_ids.extend(it["tokens"])
    item.proposal.distributions.extend(it["dists"])
    return item


# --------------------------------------------------------------------------- target Verify


@FUZZ
@given(plan=verify_plan())
def test_target_verify_survives_bad_input(fuzz_stack, channels, plan):
    loop, _, store = fuzz_stack
    stub = target_pb2_grpc.TargetServiceStub(channels["target"])
    known = _new_session(fuzz_stack, greedy=plan["greedy"]) if plan["items"] else None
    record = loop.run(store.load(known)) if known else None
    request = target_pb2.VerifyRequest(items=[_plan_item(it, known, record) for it in plan["items"]])
    replies = []
    code, details = _code(lambda: replies.append(stub.Verify(request, timeout=60)))
    _assert_clean(code, details, request)
    if known is not None:  # whatever happened, the log is the prompt plus at most one verdict
        after = loop.run(store.load(known))
        verdicts = [
            r.verdict for r in (replies[0].results if replies else ()) if r.WhichOneof("outcome") == "verdict"
        ]
        assert len(verdicts) <= 1
        committed = tuple(verdicts[0].committed_token_ids) if verdicts else ()
        assert after.token_ids == PROMPT + committed and after.version == (1 if verdicts else 0)
        event("committed a verdict" if verdicts else "committed nothing")


@st.composite
def mixed_verify_plan(draw) -> dict:
    """1 to 3 bad (or extreme) items, each from :func:`verify_plan` (whole-request defects aside: no
    items, 40 items), and where in the batch the two good items go."""
    bad = []
    for _ in range(draw(st.integers(1, 3))):
        plan = draw(verify_plan())
        if len(plan["items"]) == 1:
            bad.append((plan["greedy"], plan["items"][0]))
    order = draw(st.permutations(list(range(len(bad) + 2))))
    return {"bad": bad, "order": order}


def _good_items(fuzz_stack, pair) -> tuple[list[tuple[str, target_pb2.VerifyItem]], list[target_pb2.VerifyItem]]:
    """A greedy and a sampled session with well-formed proposals, and twins of them: ([(sid, item)], twin items)."""
    greedy = sf.reference_greedy(pair.target_dir, PROMPT, 3, ignore_eos=True)
    proposals = [
        (True, common_pb2.Proposal(token_ids=greedy)),
        (
            False,
            common_pb2.Proposal(
                token_ids=[17, 42],
                distributions=[
                    common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=_dense_bytes("good", s, 0)))
                    for s in (1, 2)
                ],
            ),
        ),
    ]
    goods, twins = [], []
    for is_greedy, proposal in proposals:
        for out in (goods, twins):
            sid = _new_session(fuzz_stack, greedy=is_greedy)
            base = common_pb2.SessionBase(session_id=sid, committed_len=len(PROMPT), version=0)
            item = target_pb2.VerifyItem(base=base, proposal=proposal)
            out.append((sid, item) if out is goods else item)
    return goods, twins


@FUZZ
@given(plan=mixed_verify_plan())
def test_bad_items_never_change_the_verdicts_of_good_items_in_the_same_batch(fuzz_stack, channels, pair, plan):
    """Bad items batched with good ones: the call succeeds, each bad item gets its own clean status, and
    each good item commits exactly the verdict its twin gets verified alone (the batch-mates are verified as
    if the bad items were absent)."""
    loop, _, store = fuzz_stack
    stub = target_pb2_grpc.TargetServiceStub(channels["target"])
    goods, twins = _good_items(fuzz_stack, pair)
    bad_items = []
    for greedy, it in plan["bad"]:
        known = _new_session(fuzz_stack, greedy=greedy)
        bad_items.append(_plan_item(it, known, loop.run(store.load(known))))
    pool = [item for _, item in goods] + bad_items
    request = target_pb2.VerifyRequest(items=[pool[i] for i in plan["order"]])
    reply = stub.Verify(request, timeout=60)  # never refused whole: each item has its own fate
    by_position = {plan["order"][k]: r for k, r in enumerate(reply.results)}
    for g, ((sid, _), twin) in enumerate(zip(goods, twins, strict=True)):
        got = by_position[g]
        assert got.session_id == sid and got.WhichOneof("outcome") == "verdict", got
        alone = stub.Verify(target_pb2.VerifyRequest(items=[twin]), timeout=60).results[0]
        assert got.verdict == alone.verdict
    for k in range(2, len(pool)):
        result = by_position[k]
        if result.WhichOneof("outcome") == "error":
            _assert_clean(_STATUS[result.error.code], result.error.message, request)
            event(f"bad item {_STATUS[result.error.code].name}")


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


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


def _propose_request(plan: dict) -> draft_pb2.ProposeRequest:
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
            common_pb2.SessionBase(session_id=sid, committed_len=plan["committed_len"], version=plan["version"])
        )
    return request


@FUZZ
@given(plan=propose_plan())
def test_draft_propose_survives_bad_input(channels, plan):
    stub = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    request = _propose_request(plan)
    code, details = _code(lambda: stub.Propose(request, timeout=60))
    _assert_clean(code, details, request)


@FUZZ
@given(plans=st.lists(propose_plan(), min_size=1, max_size=3))
def test_bad_proposes_never_change_a_good_one_beside_them(fuzz_stack, pair, plans):
    """A good greedy Propose sent together with bad ones gets the draft model's own greedy continuation."""
    loop, stack, _ = fuzz_stack
    expected = _draft_reference(pair)

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft_port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            good = stub.Propose(_good_propose(), timeout=60)
            bad = [stub.Propose(_propose_request(p), timeout=60) for p in plans]
            results = await asyncio.gather(good, *bad, return_exceptions=True)
        return results[0], results[1:]

    good, bad = loop.run(run())
    assert not isinstance(good, BaseException), good
    assert list(good.proposal.token_ids) == expected
    for plan, result in zip(plans, bad, strict=True):
        code = result.code() if isinstance(result, grpc.aio.AioRpcError) else grpc.StatusCode.OK
        assert not isinstance(result, BaseException) or isinstance(result, grpc.aio.AioRpcError), result
        _assert_clean(code, "", plan)


_DRAFT_REFERENCE: list[int] = []


def _draft_reference(pair) -> list[int]:
    if not _DRAFT_REFERENCE:
        _DRAFT_REFERENCE.extend(sf.reference_greedy(pair.draft_dir, PROMPT, 5, ignore_eos=True))
    return list(_DRAFT_REFERENCE)


def _good_propose() -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        base=common_pb2.SessionBase(session_id=f"fuzz-{uuid.uuid4().hex}", committed_len=len(PROMPT)),
        start_position=0,
        token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        gamma=5,
        proposer=common_pb2.PROPOSER_KIND_MODEL,
    )


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


@FUZZ
@given(bads=st.lists(generate_plan(), min_size=1, max_size=3))
def test_bad_generate_requests_never_hurt_a_good_one_running_beside_them(fuzz_stack, pair, bads):
    """Bad and extreme requests running at the same time as a good greedy one: each ends cleanly, the good
    one gets the target's own generate() with draft proposals, and no breaker opened (a request's own
    refusal is never held against a replica)."""
    loop, stack, _ = fuzz_stack
    expected = sf.reference_greedy(pair.target_dir, PROMPT, MAX_NEW_LIMIT, ignore_eos=True)

    async def run():
        good = Stream(sf.request(PROMPT, max_new_tokens=MAX_NEW_LIMIT, gamma=2, ignore_eos=True))
        bad = [Stream(b) for b in bads]
        await asyncio.gather(*(s.run(stack.address, timeout_s=60) for s in (good, *bad)))
        return good, bad

    good, bad = loop.run(run())
    assert good.ok and good.tokens == expected, (good.code, good.details)
    assert good.stats.proposed_tokens > 0
    for s in bad:
        _assert_clean(s.code, s.details, s.request)
        if s.ok:
            assert len(s.tokens) <= MAX_NEW_LIMIT
    pool = stack.coordinator.coordinator.pool
    for tier in (pool.drafts, pool.targets):
        assert all(tier.failures(ep) == 0 for ep in tier.endpoints), tier.name


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
