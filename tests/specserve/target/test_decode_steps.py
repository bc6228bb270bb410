"""Several target steps in one Verify call (``VerifyItem.decode_steps``, gamma = 0 items).

The promise: a call of ``k`` steps commits exactly the tokens (and log
probabilities) that ``k`` gamma = 0 rounds would, in one compare-and-set, and
stops where a round would have stopped. Each test runs a twin session with the
same prompt, settings and seed one step per call and compares, on the tiny
Llama and GPT-2 targets and a real Redis.
"""

from __future__ import annotations

import dataclasses

import pytest
from target_helpers import (
    GREEDY,
    NAN_AT,
    assert_cache_holds,
    greedy_continuation,
    item,
    make_verifier,
    new_session,
)
from test_verifier import PROMPT, RacingStore

from specserve.api.errors import VersionConflict
from specserve.api.params import SamplingParams, StopConditions
from specserve.target.messages import VerifyBatch
from specserve.v1 import common_pb2

SETTINGS = {
    "greedy": GREEDY,
    "greedy+penalty": SamplingParams(temperature=0.0, repetition_penalty=1.3),
    "sampled": SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=77),
    "coupled": SamplingParams(temperature=1.1, seed=78, sampling_mode="coupled"),
}


def steps_item(record, steps: int, tokens=(), *, top_logprobs=None):
    return dataclasses.replace(item(record, tokens, top_logprobs=top_logprobs), decode_steps=steps)


async def one_step_run(verifier, store, record):
    """The twin: one gamma = 0 round per call until the session finishes; its final record and logprobs."""
    logprobs = []
    while not record.finished:
        result = (await verifier.verify(VerifyBatch(items=(steps_item(record, 1, top_logprobs=2),)))).results[0]
        assert result.verdict is not None, result.error
        logprobs.extend(result.verdict.logprobs)
        record = await store.load(record.session_id)
    return record, logprobs


def assert_same_logprobs(got, want):
    """Same tokens and alternatives; values within float rounding (a batched pass pads its rows)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.token_id for t in g.top_logprobs] == [t.token_id for t in w.top_logprobs]


@pytest.mark.parametrize("name", list(SETTINGS), ids=list(SETTINGS))
async def test_k_steps_in_one_call_commit_what_k_gamma_zero_rounds_commit(target, draft, store, name):
    """Sessions decoded 4 steps per call, two of them in one batch beside a session with a draft proposal,
    end with the same tokens and log probabilities as a twin decoded one step per call; each call is one
    commit (one version), the last call is cut at max_new_tokens, and every cache holds its log."""
    params = SETTINGS[name]
    stop = StopConditions(max_new_tokens=10, ignore_eos=True)
    verifier = make_verifier(target, store)
    twin, twin_logprobs = await one_step_run(verifier, store, await new_session(store, PROMPT, params, stop))
    a = await new_session(store, PROMPT, params, stop)
    b = await new_session(store, PROMPT[:5], params, stop)
    twin_b, twin_b_logprobs = await one_step_run(
        verifier, store, await new_session(store, PROMPT[:5], params, stop)
    )
    mate = await new_session(store, PROMPT, GREEDY)
    calls, logprobs = 0, {a.session_id: [], b.session_id: []}
    while not (a.finished and b.finished):
        items = [steps_item(r, 4, top_logprobs=2) for r in (a, b) if not r.finished]
        items.append(item(mate, greedy_continuation(draft, mate.token_ids, 2)))
        results = (await verifier.verify(VerifyBatch(items=tuple(items)))).results
        calls += 1
        for r in results[:-1]:
            assert r.verdict is not None, r.error
            assert r.verdict.new_version == calls and r.verdict.accepted_count == 0
            logprobs[r.session_id].extend(r.verdict.logprobs)
        assert results[-1].verdict is not None  # the speculative batch mate is verified as usual
        a, b, mate = [await store.load(r.session_id) for r in (a, b, mate)]
    assert calls == 3  # 4 + 4 + 2 tokens
    for got, want, want_logprobs in ((a, twin, twin_logprobs), (b, twin_b, twin_b_logprobs)):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert got.version == 3 and want.version == 10
        assert_same_logprobs(logprobs[got.session_id], want_logprobs)
        assert_cache_holds(verifier, got.session_id, got.token_ids)
    verifier.close()


async def test_steps_stop_at_a_stop_token_inside_the_call(target, store):
    """A stop token met at the second of 5 steps ends the call there: two tokens, finish stop_token."""
    chain = greedy_continuation(target, PROMPT, 3)
    stop = StopConditions(max_new_tokens=20, ignore_eos=True, stop_token_ids=(chain[1],))
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, GREEDY, stop)
    verdict = (await verifier.verify(VerifyBatch(items=(steps_item(record, 5),)))).results[0].verdict
    want = chain[: chain.index(chain[1]) + 1]  # the first occurrence of the stop token ends it
    assert verdict.committed_token_ids == tuple(want)
    assert verdict.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN and verdict.new_version == 1
    assert await store.read_tokens(record.session_id) == PROMPT + tuple(want)
    verifier.close()


async def test_a_lost_compare_and_set_commits_none_of_the_steps(target, store):
    """Two rival commits before ours: VersionConflict, none of the 4 steps is in the log, and the cache is
    rolled back to the prefix the call started from."""
    verifier = make_verifier(target, RacingStore(store, 2))
    record = await new_session(store, PROMPT)
    result = (await verifier.verify(VerifyBatch(items=(steps_item(record, 4),)))).results[0]
    assert isinstance(result.error, VersionConflict)
    assert await store.read_tokens(record.session_id) == (*PROMPT, 1, 1)
    assert verifier.caches.get(record.session_id).tokens == PROMPT[:-1]
    verifier.close()


async def test_a_step_that_fails_alone_ends_the_steps_and_the_ones_before_it_are_committed(
    poisoned_target, store
):
    """The GPT-2 target with NaN at position NAN_AT: of 4 steps asked for, the first two feed positions before
    it and commit; the third has no distribution, so the call commits those two (one version) and the
    session's cache holds its log; the next call then fails for itself, committing nothing."""
    prompt = tuple(range(1, NAN_AT))  # positions 0 .. NAN_AT - 2
    verifier = make_verifier(poisoned_target, store)
    record = await new_session(store, prompt, GREEDY)
    result = (await verifier.verify(VerifyBatch(items=(steps_item(record, 4),)))).results[0]
    assert result.verdict is not None and len(result.verdict.committed_token_ids) == 2
    assert result.verdict.new_version == 1 and result.verdict.committed_len == len(prompt) + 2
    assert result.verdict.committed_token_ids == tuple(greedy_continuation(poisoned_target, prompt, 2))
    record = await store.load(record.session_id)
    assert record.token_ids == prompt + result.verdict.committed_token_ids
    assert verifier.caches.get(record.session_id).tokens == record.token_ids[:-1]
    again = (await verifier.verify(VerifyBatch(items=(steps_item(record, 4),)))).results[0]
    assert type(again.error).__name__ == "InvalidDistribution"
    assert await store.read_tokens(record.session_id) == record.token_ids
    verifier.close()


@pytest.mark.parametrize("name", list(SETTINGS), ids=list(SETTINGS))
async def test_a_proposal_then_steps_commits_what_its_round_and_gamma_zero_rounds_commit(target, draft, store, name):
    """An item with a proposal (the draft's greedy guess, point masses) and 4 steps: the first step verifies the
    proposal, the 3 after it decode as gamma = 0 rounds would. It ends with the tokens and log probabilities of
    a twin that verified the same proposal in a call of its own and then ran three gamma = 0 rounds, in one
    commit, with the proposal's accepted count; and its cache holds its log."""
    params = SETTINGS[name]
    stop = StopConditions(max_new_tokens=12, ignore_eos=True)
    verifier = make_verifier(target, store)
    proposal = tuple(greedy_continuation(draft, PROMPT, 3))
    twin = await new_session(store, PROMPT, params, stop)
    first = (await verifier.verify(VerifyBatch(items=(item(twin, proposal, top_logprobs=2),)))).results[0].verdict
    assert first is not None
    twin_logprobs = list(first.logprobs)
    for _ in range(3):
        twin = await store.load(twin.session_id)
        result = (await verifier.verify(VerifyBatch(items=(steps_item(twin, 1, top_logprobs=2),)))).results[0]
        assert result.verdict is not None, result.error
        twin_logprobs.extend(result.verdict.logprobs)
    twin = await store.load(twin.session_id)

    record = await new_session(store, PROMPT, params, stop)
    probe = dataclasses.replace(item(record, proposal, top_logprobs=2), decode_steps=4)
    result = (await verifier.verify(VerifyBatch(items=(probe,)))).results[0]
    assert result.verdict is not None, result.error
    assert result.verdict.new_version == 1 and result.verdict.accepted_count == first.accepted_count
    record = await store.load(record.session_id)
    assert record.token_ids == twin.token_ids
    assert len(record.token_ids) == len(PROMPT) + len(first.committed_token_ids) + 3
    assert_same_logprobs(list(result.verdict.logprobs), twin_logprobs)
    assert_cache_holds(verifier, record.session_id, record.token_ids)
    verifier.close()
