"""The DraftService over real gRPC on 127.0.0.1: proposals, resync, n-gram, bad input, release."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from draft_helpers import MAX_GAMMA, draft_settings
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.api.constraints import Constraint
from specserve.api.params import SamplingParams, SessionBase
from specserve.core.proposal import draft_probs_from_pb
from specserve.core.rng import Purpose, uniform
from specserve.core.sampling import logits_to_probs, sample_from
from specserve.draft.server import start_draft
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.system

PROMPT = [5, 17, 42, 99, 3, 250, 7, 11, 64, 120]


@pytest.fixture
async def stub(draft_app):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{draft_app.port}") as channel:
        yield draft_pb2_grpc.DraftServiceStub(channel)


@pytest.fixture
async def llama_stub(llama_app):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{llama_app.port}") as channel:
        yield draft_pb2_grpc.DraftServiceStub(channel)


def request(
    sid: str,
    committed: list[int],
    *,
    start: int = 0,
    gamma: int = 4,
    params: SamplingParams | None = None,
    proposer: int = common_pb2.PROPOSER_KIND_MODEL,
    draft_top_k: int = 0,
) -> draft_pb2.ProposeRequest:
    params = params or SamplingParams(temperature=1.0, seed=3)
    return draft_pb2.ProposeRequest(
        base=SessionBase(sid, committed_len=len(committed), version=0).to_pb(),
        start_position=start,
        token_ids=committed[start:],
        sampling=params.to_pb(),
        gamma=gamma,
        proposer=proposer,
        draft_top_k=draft_top_k,
        seed=params.seed,
    )


def _with_tree(req: draft_pb2.ProposeRequest, max_nodes: int, threshold: float) -> draft_pb2.ProposeRequest:
    req.tree_max_nodes = max_nodes
    req.tree_min_path_probability = threshold
    return req


def _constrained(req: draft_pb2.ProposeRequest) -> draft_pb2.ProposeRequest:
    constrained = SamplingParams(temperature=1.0, seed=3, constraint=Constraint("regex", "[a-z]+"))
    req.sampling.CopyFrom(constrained.to_pb())
    req.prompt_len = len(req.token_ids)
    return req


def _with_min_confidence(req: draft_pb2.ProposeRequest, value: float) -> draft_pb2.ProposeRequest:
    req.min_confidence = value
    return req


@torch.inference_mode()
def direct_probs(model, seq, params) -> torch.Tensor:
    """The draft's processed distribution after ``seq`` by a fresh, uncached model call; [vocab] float32."""
    logits = model(input_ids=torch.tensor([seq])).logits[0, -1:].float()  # [1, vocab]
    return logits_to_probs(logits, params, [seq]).float()[0]


def assert_same_proposal(a: common_pb2.Proposal, b: common_pb2.Proposal, vocab_size: int) -> None:
    """Same tokens; same distributions up to float rounding (a re-prefill rounds differently)."""
    assert list(a.token_ids) == list(b.token_ids)
    assert len(a.distributions) == len(b.distributions)
    if a.distributions:
        qa = draft_probs_from_pb(a.distributions, vocab_size)
        qb = draft_probs_from_pb(b.distributions, vocab_size)
        torch.testing.assert_close(qa, qb, atol=1e-5, rtol=0)


async def expect_code(coro, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


async def test_propose_ships_the_draft_models_processed_distributions(stub, draft_app):
    params = SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=12)
    reply = await stub.Propose(request("dist", PROMPT, gamma=5, params=params))
    tokens = list(reply.proposal.token_ids)
    assert len(tokens) == 5 and len(reply.proposal.distributions) == 5
    assert reply.prefill_tokens == len(PROMPT) and reply.draft_ns > 0
    dense = [d.dense.probs_f32le for d in reply.proposal.distributions]
    assert all(len(raw) == 4 * draft_app.model.vocab_size for raw in dense)
    q = draft_probs_from_pb(
        reply.proposal.distributions, draft_app.model.vocab_size
    )  # what a target rebuilds
    seq = list(PROMPT)
    for i, token in enumerate(tokens):
        shipped = torch.from_numpy(np.frombuffer(dense[i], dtype="<f4").copy())
        torch.testing.assert_close(
            shipped, direct_probs(draft_app.model.model, seq, params), atol=1e-5, rtol=0
        )
        assert q[i, token] > 0
        assert token == sample_from(q[i], uniform(12, len(PROMPT) + i, Purpose.DRAFT))
        seq.append(token)


async def test_truncated_draft_ships_a_sparse_support(stub, draft_app):
    params = SamplingParams(temperature=1.0, seed=5)
    reply = await stub.Propose(request("sparse", PROMPT, gamma=3, params=params, draft_top_k=4))
    seq = list(PROMPT)
    for token, dist in zip(reply.proposal.token_ids, reply.proposal.distributions, strict=True):
        assert dist.WhichOneof("support") == "sparse"
        full = direct_probs(draft_app.model.model, seq, params).double()
        top = torch.topk(full, 4).indices
        assert sorted(dist.sparse.token_ids) == sorted(top.tolist())
        expected = full[list(dist.sparse.token_ids)] / full[top].sum()
        torch.testing.assert_close(
            torch.tensor(list(dist.sparse.probs), dtype=torch.float64), expected, atol=1e-6, rtol=0
        )
        assert token in dist.sparse.token_ids
        seq.append(token)


async def test_greedy_proposals_equal_the_drafts_own_generate(stub, draft_app):
    """Three rounds with rejections at the first, a middle and the last position; each matches generate()."""
    model = draft_app.model.model
    greedy = SamplingParams(temperature=0.0, seed=0)
    committed = list(PROMPT)
    seen = 0
    for accepted in (0, 2, 4):
        reply = await stub.Propose(request("greedy", committed, start=seen, gamma=4, params=greedy))
        assert len(reply.proposal.distributions) == 0  # greedy: tokens only
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([committed]), max_new_tokens=4, do_sample=False, pad_token_id=0
            )[0, len(committed) :].tolist()
        assert list(reply.proposal.token_ids)[: len(out)] == out
        drafted = list(reply.proposal.token_ids)
        cache = draft_app.caches.get("greedy")
        assert cache.tokens == (*committed, *drafted[:-1])  # C + x1..x_{gamma-1}
        # The coordinator commits `accepted` tokens and a correction that differs from the draft's next one.
        correction = (drafted[accepted] + 1) % draft_app.model.vocab_size if accepted < 4 else 33
        seen = len(committed)
        committed = [*committed, *drafted[:accepted], correction]
    reply = await stub.Propose(request("greedy", committed, start=seen, gamma=4, params=greedy))
    # After all 4 were accepted only x4 and the bonus token had to be fed.
    assert reply.prefill_tokens == 2
    out = model.generate(
        input_ids=torch.tensor([committed]), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    assert (
        list(reply.proposal.token_ids)[: out.shape[1] - len(committed)] == out[0, len(committed) :].tolist()
    )


async def test_same_request_twice_gives_the_same_proposal(stub, draft_app):
    params = SamplingParams(temperature=1.0, seed=99)
    first = await stub.Propose(request("retry", PROMPT, gamma=6, params=params))
    second = await stub.Propose(request("retry", PROMPT, gamma=6, params=params))
    assert_same_proposal(first.proposal, second.proposal, draft_app.model.vocab_size)
    other = await stub.Propose(
        request("retry2", PROMPT, gamma=6, params=SamplingParams(temperature=1.0, seed=98))
    )
    assert other.proposal.token_ids != first.proposal.token_ids


async def test_unknown_prefix_is_failed_precondition_and_resend_from_zero_works(llama_stub, llama_app):
    await expect_code(
        llama_stub.Propose(request("cold", PROMPT, start=4)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "resend the committed tokens from position 0",
    )
    reply = await llama_stub.Propose(request("cold", PROMPT, start=0))
    assert reply.prefill_tokens == len(PROMPT)
    committed = [*PROMPT, *reply.proposal.token_ids[:1], 7]
    reply = await llama_stub.Propose(request("cold", committed, start=len(PROMPT)))
    assert len(reply.proposal.token_ids) == 4
    await llama_stub.ReleaseDraftSession(draft_pb2.ReleaseDraftSessionRequest(session_id="cold"))
    await expect_code(
        llama_stub.Propose(request("cold", committed, start=len(PROMPT))),
        grpc.StatusCode.FAILED_PRECONDITION,
        "position 0",
    )
    again = await llama_stub.Propose(request("cold", committed, start=0))
    assert again.prefill_tokens == len(committed)
    assert_same_proposal(again.proposal, reply.proposal, llama_app.model.vocab_size)  # rebuilt: same draft


async def test_an_ngram_propose_is_refused_the_coordinator_drafts_it(llama_stub):
    pattern = [10, 20, 30, 40, 50, 60]
    await expect_code(
        llama_stub.Propose(request("ngram", pattern * 2, gamma=3, proposer=common_pb2.PROPOSER_KIND_NGRAM)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "coordinator drafts",
    )


async def test_bad_input_is_refused_precisely_and_the_session_stays_usable(llama_stub, llama_app):
    vocab = llama_app.model.vocab_size
    first = await llama_stub.Propose(request("bad", PROMPT))
    cases = [
        (request("bad", PROMPT, gamma=MAX_GAMMA + 1), grpc.StatusCode.INVALID_ARGUMENT, "max_gamma"),
        (request("bad", [*PROMPT, vocab]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (request("bad", [*PROMPT, 2**31]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (request("bad", PROMPT, draft_top_k=vocab + 1), grpc.StatusCode.INVALID_ARGUMENT, "draft_top_k"),
        (request("bad", [], gamma=2), grpc.StatusCode.INVALID_ARGUMENT, "committed_len"),
        *(
            (_with_min_confidence(request("bad", PROMPT), c), grpc.StatusCode.INVALID_ARGUMENT, "[0, 1)")
            for c in (1.0, -0.25, float("nan"), float("inf"))
        ),
        (_with_tree(request("bad", PROMPT), 257, 0.1), grpc.StatusCode.INVALID_ARGUMENT, "tree_max_nodes"),
        (_with_tree(request("bad", PROMPT), 8, 1.5), grpc.StatusCode.INVALID_ARGUMENT, "path_probability"),
        (_with_tree(_constrained(request("bad", PROMPT)), 8, 0.1), grpc.StatusCode.INVALID_ARGUMENT, "a chain"),
    ]
    for req, code, match in cases:
        await expect_code(llama_stub.Propose(req), code, match)
    wrong_len = request("bad", PROMPT)
    wrong_len.base.committed_len = len(PROMPT) + 3
    await expect_code(llama_stub.Propose(wrong_len), grpc.StatusCode.INVALID_ARGUMENT, "start_position")
    bad_temp = request("bad", PROMPT)
    bad_temp.sampling.temperature = -1.0
    await expect_code(llama_stub.Propose(bad_temp), grpc.StatusCode.INVALID_ARGUMENT, "temperature")
    long_scope = request("bad", PROMPT)
    long_scope.cache_scope = b"s" * 65
    await expect_code(llama_stub.Propose(long_scope), grpc.StatusCode.INVALID_ARGUMENT, "cache_scope has 65 bytes")
    await expect_code(
        llama_stub.ReleaseDraftSession(draft_pb2.ReleaseDraftSessionRequest(session_id="never-seen")),
        grpc.StatusCode.NOT_FOUND,
        "never-seen",
    )
    # The session is intact: the history still knows PROMPT, so an incremental request works
    # and a retry of the first request gives the first proposal.
    later = await llama_stub.Propose(request("bad", PROMPT, start=len(PROMPT)))
    assert_same_proposal(later.proposal, first.proposal, vocab)
    assert llama_app.caches.get("bad").committed_len == len(PROMPT)


async def test_a_history_longer_than_the_context_is_refused_before_any_work(llama_draft):
    """The tiny draft's context is 512 positions: a Propose carrying a longer committed history (or one
    claiming a longer session) is INVALID_ARGUMENT, and nothing is recorded for the session; a smaller
    max_session_tokens setting lowers the limit further."""
    app = await start_draft(draft_settings(max_session_tokens=100), model=llama_draft)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            too_long = request("long", [5] * 101, gamma=2)
            await expect_code(stub.Propose(too_long), grpc.StatusCode.INVALID_ARGUMENT, "at most 100 tokens")
            claimed = request("long", [5] * 4, start=4, gamma=2)
            claimed.base.committed_len = 2_000_000
            await expect_code(stub.Propose(claimed), grpc.StatusCode.INVALID_ARGUMENT, "at most 100 tokens")
            assert "long" not in app.engine.history and "long" not in app.caches
            assert len((await stub.Propose(request("long", [5] * 100, gamma=2))).proposal.token_ids) == 2
    finally:
        await app.stop(0)
    app = await start_draft(draft_settings(), model=llama_draft)  # the default: the model's context caps it
    try:
        assert app.servicer.max_tokens == 512
    finally:
        await app.stop(0)


async def test_release_drops_the_cache(llama_stub, llama_app):
    await llama_stub.Propose(request("rel", PROMPT))
    assert "rel" in llama_app.caches
    await llama_stub.ReleaseDraftSession(draft_pb2.ReleaseDraftSessionRequest(session_id="rel"))
    assert "rel" not in llama_app.caches
    await expect_code(
        llama_stub.ReleaseDraftSession(draft_pb2.ReleaseDraftSessionRequest(session_id="rel")),
        grpc.StatusCode.NOT_FOUND,
        "rel",
    )


async def test_get_draft_info_and_health(llama_stub, llama_app):
    info = await llama_stub.GetDraftInfo(draft_pb2.GetDraftInfoRequest())
    assert info.max_gamma == MAX_GAMMA
    assert info.model.vocab_size == llama_app.model.vocab_size
    assert info.model.vocab_fingerprint == llama_app.model.vocab_fingerprint
    assert info.model.dtype == "float32" and info.model.device == "cpu"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{llama_app.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="specserve.v1.DraftService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_gamma_zero_returns_an_empty_proposal(llama_stub):
    reply = await llama_stub.Propose(request("zero", PROMPT, gamma=0))
    assert list(reply.proposal.token_ids) == [] and reply.prefill_tokens == 0
    assert (
        await llama_stub.Propose(request("zero", PROMPT, start=len(PROMPT), gamma=2))
    ).prefill_tokens == len(PROMPT)


async def test_kv_evicted_session_is_rebuilt_from_the_history(llama_draft):
    """A KV budget that fits one session: B's proposal evicts A's cache; A continues, re-prefilled."""
    app = await start_draft(draft_settings(kv_budget_bytes=1024), model=llama_draft)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            first = await stub.Propose(request("A", PROMPT))
            await stub.Propose(request("B", PROMPT[:5]))
            assert "A" not in app.caches and "B" in app.caches
            again = await stub.Propose(request("A", PROMPT, start=len(PROMPT)))  # the history still knows A
            assert again.prefill_tokens == len(PROMPT)
            assert_same_proposal(again.proposal, first.proposal, llama_draft.vocab_size)
    finally:
        await app.stop(0)


async def test_session_evicted_from_the_history_must_resend(llama_draft):
    app = await start_draft(draft_settings(max_sessions=1), model=llama_draft)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            first = await stub.Propose(request("A", PROMPT))
            await stub.Propose(request("B", PROMPT))
            assert "A" not in app.caches  # dropped together with its history
            await expect_code(
                stub.Propose(request("A", PROMPT, start=len(PROMPT))),
                grpc.StatusCode.FAILED_PRECONDITION,
                "position 0",
            )
            again = await stub.Propose(request("A", PROMPT))
            assert_same_proposal(again.proposal, first.proposal, llama_draft.vocab_size)
    finally:
        await app.stop(0)


async def test_propose_batch_gives_each_session_what_propose_gives_it(llama_stub, llama_draft):
    """Mixed greedy and sampled sessions in one ProposeBatch; a second server answers each alone: same bytes."""
    items = [
        request("pb-g", PROMPT, gamma=3, params=SamplingParams(temperature=0.0)),
        request("pb-s", PROMPT[:4], gamma=5, params=SamplingParams(temperature=0.9, seed=4)),
        request("pb-k", PROMPT[2:], gamma=2, params=SamplingParams(temperature=1.0, seed=8), draft_top_k=6),
    ]
    reply = await llama_stub.ProposeBatch(draft_pb2.ProposeBatchRequest(items=items))
    assert reply.draft_ns > 0 and len(reply.results) == 3
    other = await start_draft(draft_settings(), model=llama_draft)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{other.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            for item, result in zip(items, reply.results, strict=True):
                assert result.WhichOneof("outcome") == "proposal"
                alone = await stub.Propose(item)
                assert result.proposal.proposal.SerializeToString() == alone.proposal.SerializeToString()
                assert result.proposal.prefill_tokens == alone.prefill_tokens
    finally:
        await other.stop(0)


async def test_propose_batch_items_fail_on_their_own(llama_stub):
    items = [
        request("pbe-ok", PROMPT),
        request("pbe-cold", PROMPT, start=4),  # unknown session: resend from 0
        request("pbe-big", PROMPT, gamma=MAX_GAMMA + 1),  # malformed
        request("pbe-ok2", PROMPT[:3], gamma=2),
    ]
    reply = await llama_stub.ProposeBatch(draft_pb2.ProposeBatchRequest(items=items))
    outcomes = [r.WhichOneof("outcome") for r in reply.results]
    assert outcomes == ["proposal", "error", "error", "proposal"]
    assert reply.results[1].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "position 0" in reply.results[1].error.message
    assert reply.results[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "max_gamma" in reply.results[2].error.message
    assert len(reply.results[0].proposal.proposal.token_ids) == 4
    assert len(reply.results[3].proposal.proposal.token_ids) == 2


async def test_propose_batch_refuses_more_items_than_it_takes(llama_draft):
    app = await start_draft(draft_settings(max_batch_size=2), model=llama_draft)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            assert (await stub.GetDraftInfo(draft_pb2.GetDraftInfoRequest())).max_batch_size == 2
            items = [request(f"over{i}", PROMPT) for i in range(3)]
            await expect_code(
                stub.ProposeBatch(draft_pb2.ProposeBatchRequest(items=items)),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "at most 2",
            )
            await expect_code(
                stub.ProposeBatch(draft_pb2.ProposeBatchRequest()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "at least one",
            )
            same = [request("twice", PROMPT), request("twice", PROMPT)]
            reply = await stub.ProposeBatch(draft_pb2.ProposeBatchRequest(items=same))
            assert [r.WhichOneof("outcome") for r in reply.results] == ["proposal", "error"]
            assert "appears twice" in reply.results[1].error.message
    finally:
        await app.stop(0)


async def test_a_stop_token_ends_the_proposal(llama_stub):
    greedy = SamplingParams(temperature=0.0)
    free = await llama_stub.Propose(request("stop-free", PROMPT, gamma=4, params=greedy))
    second = free.proposal.token_ids[1]
    stopping = request("stop-cut", PROMPT, gamma=4, params=greedy)
    stopping.stop_token_ids.append(second)
    cut = await llama_stub.Propose(stopping)
    end = list(free.proposal.token_ids).index(second) + 1
    assert list(cut.proposal.token_ids) == list(free.proposal.token_ids)[:end]
