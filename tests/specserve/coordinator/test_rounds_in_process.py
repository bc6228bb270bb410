"""``RoundLoop.step`` in process: a real round loop and ``WorkerPool`` over fake replicas and a fake store
(``worker_fakes``), each round through ``step`` alone.

What a session streams is exactly the fake target's greedy text, each token once, across a replica
failover, a dead draft, a refused proposal and a log that moved behind the session's back (ABORTED: the
loop re-reads it); a session whose log is gone or that keeps being refused fails with
FAILED_PRECONDITION. ``tests/specserve/coordinator/test_rounds_faults.py`` runs faults of this kind through the whole
system.
"""

from __future__ import annotations

import pytest
from worker_fakes import FakeTarget, Workers, continuation, item_for, new_session, pool_of_fakes, round_loop

from specserve.api import errors
from specserve.coordinator.round import MAX_FRUITLESS_RESYNCS, RoundLoop
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.policy import FixedGamma

pytestmark = pytest.mark.unit


def loop_for(w: Workers, session: Session, gamma: int) -> RoundLoop:
    return round_loop(session, pool=w.pool, store=w.store, policy=FixedGamma(gamma), max_gamma=8)


async def run_to_the_end(loop: RoundLoop) -> list[int]:
    out: list[int] = []
    while not loop.session.finished:
        out.extend((await loop.step()).token_ids)
    return out


async def commit_behind_its_back(
    target: FakeTarget, session: Session, rounds: int, *, logprobs: bool = False
):
    """Another owner of the session commits ``rounds`` rounds at gamma 0 (this ``session`` hears nothing)."""
    other = Session(
        session.session_id, session.token_ids, session.sampling, session.stop, session.speculation
    )
    verdicts = []
    for _ in range(rounds):
        item = item_for(other, top_logprobs=2 if logprobs else None)
        (result,) = (await target.verify([item])).results
        assert result.verdict is not None
        other.apply_verdict(result.verdict)
        verdicts.append(result.verdict)
    return verdicts


async def test_a_failover_mid_session_changes_nothing_the_client_receives():
    async with pool_of_fakes(targets=2) as w:
        (home, other) = sorted(w.targets)
        session = await new_session(w, home=home, max_new_tokens=16)
        loop = loop_for(w, session, gamma=3)
        prompt = session.token_ids
        first = (await loop.step()).token_ids
        w.targets[home].fail_next(errors.Unavailable("down"))

        out = list(first) + await run_to_the_end(loop)

        assert out == continuation(prompt, 16)
        assert list((await w.store.load(session.session_id)).generated_token_ids) == out
        failed = w.targets[home].calls[-1]
        assert w.targets[other].calls[0] == failed, "the same item, (session, version) and proposal, went on"
        assert (
            session.stats.proposed_tokens > 0
            and session.stats.accepted_tokens == session.stats.proposed_tokens
        )


async def test_a_dead_draft_leaves_every_round_at_gamma_0_and_the_text_unchanged():
    async with pool_of_fakes(targets=1, drafts=1) as w:
        (draft,) = w.drafts.values()
        (target,) = w.targets.values()
        draft.fail_next(errors.Unavailable("down"))
        session = await new_session(w, max_new_tokens=6)
        prompt = session.token_ids
        loop = loop_for(w, session, gamma=3)

        first = await loop.step()
        assert len(first.token_ids) == 1 and session.stats.proposed_tokens == 0
        out = list(first.token_ids) + await run_to_the_end(loop)

        assert out == continuation(prompt, 6)
        assert len(draft.calls) == 1, "the draft's breaker is open: later rounds make no call"
        assert all(proposal == () for call in target.calls for (_, _, proposal) in call)


async def test_a_round_whose_proposal_is_refused_commits_at_gamma_0():
    async with pool_of_fakes(targets=1, drafts=1) as w:
        (target,) = w.targets.values()
        session = await new_session(w)
        prompt = session.token_ids
        target.refuse_next(errors.InvalidArgument("a malformed proposal"))

        committed = await loop_for(w, session, gamma=3).step()

        assert [proposal for call in target.calls for (_, _, proposal) in call] == [
            tuple(continuation(prompt, 3)),
            (),
        ]
        assert committed.token_ids == tuple(continuation(prompt, 1))
        assert session.stats.rounds == 1 and session.stats.proposed_tokens == 0, "counted as last sent"


async def test_the_loop_rereads_the_log_after_aborted_and_streams_only_what_it_missed():
    async with pool_of_fakes(targets=1, drafts=0) as w:
        (target,) = w.targets.values()
        session = await new_session(w, max_new_tokens=8)
        prompt = session.token_ids
        missed = await commit_behind_its_back(target, session, 2)
        loop = loop_for(w, session, gamma=0)

        resynced = await loop.step()

        (sent,) = target.calls[-1]
        assert sent[:2] == (session.session_id, 0), "the round's item was stale"
        assert resynced.token_ids == tuple(t for v in missed for t in v.committed_token_ids)
        assert session.version == 2
        out = list(resynced.token_ids) + await run_to_the_end(loop)
        assert out == continuation(prompt, 8)


async def test_a_resync_that_missed_one_verdict_takes_its_logprobs_from_the_log():
    async with pool_of_fakes(targets=1, drafts=0) as w:
        (target,) = w.targets.values()
        session = await new_session(w, top_logprobs=2)
        (recorded,) = await commit_behind_its_back(target, session, 1, logprobs=True)
        target.refuse_next(errors.Aborted("the target refused the item"))

        resynced = await loop_for(w, session, gamma=0).step()

        assert resynced.token_ids == recorded.committed_token_ids and resynced.logprobs == recorded.logprobs
        assert session.version == 1


async def test_a_resync_past_verdicts_it_never_saw_cannot_give_their_logprobs():
    async with pool_of_fakes(targets=1, drafts=0) as w:
        (target,) = w.targets.values()
        session = await new_session(w, top_logprobs=2)
        await commit_behind_its_back(target, session, 2, logprobs=True)

        with pytest.raises(errors.FailedPrecondition, match="logprobs are not known"):
            await loop_for(w, session, gamma=0).step()


async def test_a_session_refused_again_and_again_without_progress_fails():
    async with pool_of_fakes(targets=1, drafts=0) as w:
        (target,) = w.targets.values()
        session = await new_session(w)
        loop = loop_for(w, session, gamma=0)
        target.refuse_next(*(errors.Aborted("refused") for _ in range(MAX_FRUITLESS_RESYNCS)))

        for _ in range(MAX_FRUITLESS_RESYNCS - 1):
            assert (await loop.step()).token_ids == ()
        with pytest.raises(errors.FailedPrecondition, match="keeps refusing"):
            await loop.step()


async def test_a_session_gone_from_the_store_fails_with_failed_precondition():
    async with pool_of_fakes(targets=1, drafts=0) as w:
        session = await new_session(w)
        w.store.delete(session.session_id)

        with pytest.raises(errors.FailedPrecondition, match="vanished"):
            await loop_for(w, session, gamma=0).step()
