"""The coordinator's worker clients against real draft and target servers, and idempotent commit.

A Verify retried for the same (session, version) after its reply was lost gets
the recorded verdict back (``replayed``) and commits nothing new; a stale
version is refused (VersionConflict) and the target's branch is rolled back to
the committed log. The round loop uses a replayed verdict exactly once.
"""

from __future__ import annotations

import uuid

import pytest
import pytest_asyncio
import system_fixtures as sf
from worker_fakes import round_loop

from specserve.api import errors
from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.api.status import worker_error_from_rpc as error_from_rpc
from specserve.coordinator.fleet.clients import DraftCall, DraftClient, TargetClient
from specserve.coordinator.messages import Proposal, VerifyRequest
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.acceptance import AcceptanceTracker
from specserve.coordinator.speculation.policy import FixedGamma
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.store import SessionStore
from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAMPLING = SamplingParams(temperature=1.0, seed=1234)
STOP = StopConditions(max_new_tokens=64, ignore_eos=True)


@pytest_asyncio.fixture(loop_scope="module")
async def target(stack):
    client = TargetClient(f"127.0.0.1:{stack.target_ports[0]}", CoordinatorSettings(host="127.0.0.1", target_endpoints=["x:1"]))
    yield client
    await client.close()


def _item(session_id: str, committed_len: int, version: int, proposal=(), **fields) -> VerifyRequest:
    return VerifyRequest(SessionBase(session_id, committed_len, version), Proposal(tuple(proposal)), **fields)


async def _new_session(store: SessionStore, prompt=(5, 6, 7, 8)) -> str:
    sid = f"test-{uuid.uuid4().hex}"
    await store.create(sid, prompt, SAMPLING, STOP)
    return sid


async def test_retried_verify_replays_the_recorded_verdict(stack, store, target):
    sid = await _new_session(store)
    first = (await target.verify([_item(sid, 4, 0)])).results[0]
    assert first.error is None and not first.replayed
    assert first.verdict.new_version == 1 and first.verdict.committed_len == 5
    log_after_first = await store.load(sid)
    # The reply was "lost": the same (session, version) is sent again.
    again = (await target.verify([_item(sid, 4, 0)])).results[0]
    assert again.replayed and again.verdict == first.verdict
    log_after_retry = await store.load(sid)
    assert log_after_retry.token_ids == log_after_first.token_ids and log_after_retry.version == 1


async def test_stale_version_is_refused_and_the_branch_rolled_back(stack, store, target):
    sid = await _new_session(store)
    v1 = (await target.verify([_item(sid, 4, 0)])).results[0].verdict
    v2 = (await target.verify([_item(sid, v1.committed_len, 1)])).results[0].verdict
    assert v2.new_version == 2
    # A proposal on top of the stale version 0: refused, nothing committed.
    stale = (await target.verify([_item(sid, 4, 0, (9, 10))])).results[0]
    assert stale.verdict is None and isinstance(
        stale.error, errors.VersionConflict | errors.FailedPrecondition
    )
    record = await store.load(sid)
    assert record.version == 2 and record.committed_len == v2.committed_len
    cache = stack.targets[0].caches.get(sid)
    assert cache is not None
    # Pending-token convention: the target caches C[:-1]; nothing of the refused branch remains.
    assert cache.tokens == record.token_ids[:-1]
    # The session continues from the right version.
    v3 = (await target.verify([_item(sid, record.committed_len, 2)])).results[0]
    assert v3.error is None and v3.verdict.new_version == 3


async def test_round_loop_uses_a_replayed_verdict_once(stack, store, target):
    """The old replica committed version 0 -> 1 but its reply never arrived: the round loop
    sends (session, 0) again, gets the recorded verdict, and emits those tokens exactly once."""
    prompt = (5, 6, 7, 8)
    sid = await _new_session(store, prompt)
    lost = (await target.verify([_item(sid, 4, 0)])).results[0].verdict
    session = Session(
        sid, prompt, SAMPLING, STOP, SpeculationSettings(gamma=0, proposer=common_pb2.PROPOSER_KIND_MODEL)
    )
    coordinator = stack.coordinator.coordinator
    loop = round_loop(session, pool=coordinator.pool, store=store, policy=FixedGamma(0), max_gamma=8)
    emitted = list((await loop.step()).token_ids)
    assert emitted == list(lost.committed_token_ids)
    assert session.version == 1
    for _ in range(3):
        emitted += (await loop.step()).token_ids
    record = await store.load(sid)
    assert record.version == session.version == 4
    assert list(record.generated_token_ids) == emitted
    loop.detach()
    await loop.release()
    assert sid not in stack.targets[0].caches


async def test_round_loop_resyncs_after_a_conflict(stack, store, target):
    """Someone else committed (version 0 -> 2) behind the session's back: the round loop's item is
    refused, it re-reads the log and emits only the tokens it had not emitted."""
    prompt = (5, 6, 7, 8)
    sid = await _new_session(store, prompt)
    v1 = (await target.verify([_item(sid, 4, 0)])).results[0].verdict
    await target.verify([_item(sid, v1.committed_len, 1)])
    session = Session(
        sid, prompt, SAMPLING, STOP, SpeculationSettings(gamma=0, proposer=common_pb2.PROPOSER_KIND_MODEL)
    )
    coordinator = stack.coordinator.coordinator
    loop = round_loop(session, pool=coordinator.pool, store=store, policy=FixedGamma(0), max_gamma=8)
    emitted = list((await loop.step()).token_ids)
    emitted += (await loop.step()).token_ids
    record = await store.load(sid)
    assert list(record.generated_token_ids) == emitted
    assert session.version == record.version == 3
    loop.detach()
    await loop.release()


async def test_draft_client_and_error_mapping(stack, store):
    settings = CoordinatorSettings(host="127.0.0.1", target_endpoints=["x:1"], rpc_timeout_s=5)
    client = DraftClient(f"127.0.0.1:{stack.draft_port}", settings)
    try:
        info = await client.info()
        assert info.model.vocab_size == 384 and info.max_gamma >= 8
        base = SessionBase("draft-client-test", 4, 0)
        reply = await client.propose_one(
            DraftCall(
                base,
                start_position=0,
                token_ids=(5, 6, 7, 8),
                sampling=SAMPLING,
                gamma=3,
                proposer=common_pb2.PROPOSER_KIND_MODEL,
                draft_top_k=0,
            )
        )
        assert len(reply.token_ids) == 3 and len(reply.distributions) == 3
        # A draft that lacks the earlier tokens refuses a partial resend.
        with pytest.raises(errors.FailedPrecondition):
            await client.propose_one(
                DraftCall(
                    SessionBase("never-seen", 6, 0),
                    start_position=4,
                    token_ids=(9, 10),
                    sampling=SAMPLING,
                    gamma=1,
                    proposer=common_pb2.PROPOSER_KIND_MODEL,
                    draft_top_k=0,
                )
            )
        assert await client.release("draft-client-test") is True
        assert await client.release("draft-client-test") is False
    finally:
        await client.close()
    dead = DraftClient("127.0.0.1:1", settings)
    try:
        with pytest.raises(errors.Unavailable):
            await dead.info(timeout_s=2)
    finally:
        await dead.close()


@pytest.mark.unit
async def test_error_from_rpc_covers_every_status_code():
    import grpc

    class Fake(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "boom"

    for code in grpc.StatusCode:
        err = error_from_rpc(Fake(code), "h:1")
        assert isinstance(err, errors.SpecServeError) and "boom" in err.detail and "h:1" not in err.message
    assert isinstance(error_from_rpc(Fake(grpc.StatusCode.ABORTED), "h:1"), errors.VersionConflict)
    assert isinstance(error_from_rpc(Fake(grpc.StatusCode.INTERNAL), "h:1"), errors.Unavailable)


async def test_a_malformed_proposal_falls_back_to_gamma_zero_instead_of_failing(stack, store):
    """A draft bug (a token outside the vocabulary) makes the real target refuse the item; the pool retries
    with an empty proposal and commits a plain target step."""
    prompt = (5, 6, 7, 8)
    sid = await _new_session(store, prompt)
    session = Session(
        sid, prompt, SAMPLING, STOP, SpeculationSettings(gamma=2, proposer=common_pb2.PROPOSER_KIND_MODEL)
    )
    pool = stack.coordinator.coordinator.pool
    bad = VerifyRequest(session.base, Proposal((100000, 3)))
    verified = await pool.verify(session, bad)
    assert not verified.request.proposal.token_ids
    assert verified.verdict is not None and verified.verdict.new_version == 1
    assert (await store.load(sid)).version == 1
    await pool.release(session)


async def test_a_draft_with_another_vocabulary_is_refused_at_start(
    stack, pair, tmp_path_factory, redis_server
):
    from specserve.coordinator.server import build_coordinator

    other = sf.tiny_vocab_pair(tmp_path_factory, vocab_size=6)
    async with sf.local_stack(other, redis_server.url, with_draft=True) as foreign:
        settings = CoordinatorSettings(
            host="127.0.0.1",
            redis_url=redis_server.url,
            target_endpoints=[f"127.0.0.1:{stack.target_ports[0]}"],
            draft_endpoints=[f"127.0.0.1:{foreign.draft_port}"],
        )
        with pytest.raises(errors.VocabularyMismatch, match="vocabulary"):
            await build_coordinator(settings, tokenizer=pair.tokenizer)


def _logprobs_item(session_id: str, committed_len: int, version: int) -> VerifyRequest:
    return _item(session_id, committed_len, version, top_logprobs=2)


async def test_round_loop_streams_a_replayed_verdicts_logprobs_and_fails_on_tokens_it_never_saw(
    stack, store, target
):
    """Logprobs are part of the recorded verdict: a session that lost a reply gets the tokens and their logprobs
    back from the replay. A log that moved past tokens whose verdicts it never saw cannot give their logprobs:
    the session fails rather than stream tokens without them (a session without logprobs just resyncs)."""
    prompt = (5, 6, 7, 8)
    speculation = SpeculationSettings(gamma=0, proposer=common_pb2.PROPOSER_KIND_MODEL)
    coordinator = stack.coordinator.coordinator

    sid = await _new_session(store, prompt)
    lost = (await target.verify([_logprobs_item(sid, 4, 0)])).results[0].verdict
    assert len(lost.logprobs) == len(lost.committed_token_ids) == 1
    session = Session(sid, prompt, SAMPLING, STOP, speculation, top_logprobs=2)
    loop = round_loop(session, pool=coordinator.pool, store=store, policy=FixedGamma(0), max_gamma=8)
    first = await loop.step()
    assert first.token_ids == lost.committed_token_ids and first.logprobs == lost.logprobs
    second = await loop.step()
    assert len(second.logprobs) == len(second.token_ids) == 1 and len(second.logprobs[0].top_logprobs) == 2
    loop.detach()
    await loop.release()

    for top_logprobs in (2, None):
        sid = await _new_session(store, prompt)
        v1 = (await target.verify([_logprobs_item(sid, 4, 0)])).results[0].verdict
        await target.verify([_logprobs_item(sid, v1.committed_len, 1)])
        session = Session(sid, prompt, SAMPLING, STOP, speculation, top_logprobs=top_logprobs)
        loop = round_loop(session, pool=coordinator.pool, store=store, policy=FixedGamma(0), max_gamma=8)
        if top_logprobs is None:
            assert len((await loop.step()).token_ids) == 2
        else:
            with pytest.raises(errors.FailedPrecondition, match="logprobs are not known"):
                await loop.step()
        loop.detach()
        await loop.release()


async def test_the_targets_measured_verify_cost_is_the_cost_models_prior(stack, target):
    """The target timed its verify pass for 1..max_gamma+1 positions at start-up; GetTargetInfo carries it and
    the coordinator's cost model starts from it (a one-target stack: the median is that curve)."""
    measured = stack.targets[0].verifier.verify_curve_ns
    assert len(measured) == min(stack.targets[0].settings.max_gamma + 1, 9) and min(measured) > 0
    info = await target.info()
    assert info.verify_curve_ns == measured
    cost_model = stack.coordinator.coordinator.pool.cost_model
    assert cost_model.prior.verify_curve == tuple(float(t) for t in measured)


async def test_a_model_draft_session_starts_from_the_pool_and_a_local_proposer_starts_cold(stack, store):
    """With acceptance pooled under both keys, a draft-model session is warm-started and shares its key's probe
    clock; an n-gram session (its acceptance belongs to its text) starts from the tracker's own prior with a
    clock of its own (and, drafting for free, at the best rung of the ladder for that prior)."""
    pool = stack.coordinator.coordinator.pool
    memory = stack.coordinator.coordinator.acceptance_memory
    loops = {}
    for proposer in (common_pb2.PROPOSER_KIND_MODEL, common_pb2.PROPOSER_KIND_NGRAM):
        prompt = (5, 6, 7, 8)
        session = Session(
            await _new_session(store, prompt),
            prompt,
            SAMPLING,
            STOP,
            SpeculationSettings(gamma=None, proposer=proposer),
        )
        loop = round_loop(session, pool=pool, store=store, policy=FixedGamma(0), max_gamma=8, memory=memory)
        loop.detach()
        for _ in range(40):
            memory.observe(loop.speculator.speculation_key, proposed=4, accepted=1)
        loops[proposer] = (session, loop.speculator.speculation_key)
    model_session, model_key = loops[common_pb2.PROPOSER_KIND_MODEL]
    ngram_session, ngram_key = loops[common_pb2.PROPOSER_KIND_NGRAM]
    warm = round_loop(model_session, pool=pool, store=store, policy=FixedGamma(0), max_gamma=8, memory=memory)
    cold = round_loop(ngram_session, pool=pool, store=store, policy=FixedGamma(0), max_gamma=8, memory=memory)
    try:
        assert warm.speculator.tracker.warm_start and warm.speculator.tracker.probe_clock is memory.probe_clock(model_key)
        assert memory.prior(ngram_key) is not None
        assert cold.speculator.tracker.probe_clock is not memory.probe_clock(ngram_key)
        assert cold.speculator.tracker.alpha() == pytest.approx(AcceptanceTracker().alpha())  # not the pooled 0.25
    finally:
        warm.detach()
        cold.detach()


async def test_at_gamma_0_a_local_proposers_guess_teaches_the_session_its_acceptance(stack, store):
    """An n-gram session held at gamma 0: each round its lookup's guess (made, not sent) is checked against
    the target's token, and the session's tracker learns from it (one position per round with a guess,
    accepted iff the target's token is the guess); nothing is proposed or counted in the stats. A prompt
    that repeats (5 6 7 8) x 3 gives the lookup a guess from the first round."""
    prompt = (5, 6, 7, 8) * 3
    session = Session(
        await _new_session(store, prompt),
        prompt,
        SAMPLING,
        STOP,
        SpeculationSettings(gamma=None, proposer=common_pb2.PROPOSER_KIND_NGRAM),
    )
    pool = stack.coordinator.coordinator.pool
    loop = round_loop(session, pool=pool, store=store, policy=FixedGamma(0), max_gamma=8)
    # No forgetting and no change detection: the counts below are the tracker's exactly.
    loop.speculator.tracker = AcceptanceTracker(decay=1.0, fall_threshold=1e9, rise_threshold=1e9)
    ngram = loop.speculator.source("ngram")
    guesses = matches = 0
    try:
        for _ in range(8):
            guess = ngram.shadow(1)
            committed = (await loop.step()).token_ids
            if guess:
                guesses += 1
                matches += committed[0] == guess[0]
        assert guesses >= 1
        assert session.stats.proposed_tokens == 0
        prior = AcceptanceTracker()
        expected = (matches + prior.alpha() * 2.0) / (guesses + 2.0)  # the prior's weight: 2 positions
        assert loop.speculator.tracker.alpha() == pytest.approx(expected)
    finally:
        loop.detach()
        await loop.release()
