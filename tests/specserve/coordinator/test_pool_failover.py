"""``WorkerPool``'s failover and breakers, in process: a real pool over fake replicas (``worker_fakes``).

Through the pool's public calls only (``propose``, ``verify``, the replica sets' ``failures`` / ``is_up``,
the Prometheus counter of replica failures): a target fault sends the same item, with the same
``(session, version)``, to the next replica; a failed call opens its replica's breaker once, however many
sessions it carried; a request's own error opens none; a refused proposal is retried once at gamma 0; a
draft failure leaves the round without a proposal. ``tests/specserve/coordinator/test_pool.py`` runs the same pool
against real servers.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from worker_fakes import continuation, item_for, new_session, pool_of_fakes

from specserve.api import errors
from specserve.coordinator.messages import FeatureAsk

pytestmark = pytest.mark.unit


def failures_counted(tier: str) -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_replica_failures_total", {"tier": tier}) or 0.0


@pytest.mark.parametrize(
    "fault",
    [errors.Unavailable("down"), errors.DeadlineExceeded("hung"), errors.WorkerError("a bug of the replica")],
    ids=["unavailable", "deadline", "worker-bug"],
)
async def test_a_target_fault_fails_over_to_the_next_replica_with_the_same_session_and_version(fault):
    async with pool_of_fakes(targets=2) as w:
        (home, other) = sorted(w.targets)
        session = await new_session(w, home=home)
        w.targets[home].fail_next(fault)
        before = failures_counted("target")

        verified = await w.pool.verify(session, item_for(session))

        sent = [(session.session_id, 0, ())]
        assert w.targets[home].calls == [sent] and w.targets[other].calls == [sent]
        assert verified.verdict is not None and verified.verdict.new_version == 1
        assert verified.verdict.committed_token_ids == tuple(continuation(session.token_ids, 1))
        assert not w.pool.targets.is_up(home) and w.pool.targets.failures(home) == 1
        assert w.pool.targets.is_up(other) and w.pool.targets.failures(other) == 0
        assert failures_counted("target") - before == 1


async def test_a_failed_verify_call_opens_the_breaker_once_for_all_its_sessions():
    async with pool_of_fakes(targets=2, max_batch_size=3) as w:
        (home, other) = sorted(w.targets)
        sessions = [await new_session(w, home=home) for _ in range(3)]
        w.targets[home].fail_next(errors.Unavailable("down"))
        before = failures_counted("target")

        results = await asyncio.gather(*(w.pool.verify(s, item_for(s)) for s in sessions))

        assert len(w.targets[home].calls) == 1 and len(w.targets[home].calls[0]) == 3, (
            "one call carried all three"
        )
        assert w.pool.targets.failures(home) == 1 and failures_counted("target") - before == 1
        moved = sorted(item for call in w.targets[other].calls for item in call)
        assert moved == sorted((s.session_id, 0, ()) for s in sessions)
        assert all(r.verdict is not None for r in results)


async def test_a_requests_own_error_opens_no_breaker_and_is_not_retried():
    async with pool_of_fakes(targets=2) as w:
        (home, other) = sorted(w.targets)
        session = await new_session(w, home=home)
        w.targets[home].fail_next(errors.FailedPrecondition("the session's log is not what the item says"))
        before = failures_counted("target")

        with pytest.raises(errors.FailedPrecondition):
            await w.pool.verify(session, item_for(session))

        assert w.targets[other].calls == [] and w.pool.targets.is_up(home)
        assert failures_counted("target") == before


async def test_a_refused_proposal_is_sent_again_once_at_gamma_0():
    """The target refuses the item for its proposal (INVALID_ARGUMENT: the proposal may be the draft's bug):
    the same (session, version) goes again with no proposal, on the same replica, whose breaker stays shut."""
    async with pool_of_fakes(targets=1) as w:
        (target,) = w.targets.values()
        session = await new_session(w)
        target.refuse_next(errors.InvalidArgument("token 100000 is outside the vocabulary"))

        verified = await w.pool.verify(session, item_for(session, [100000, 3]))

        sid = session.session_id
        assert target.calls == [[(sid, 0, (100000, 3))], [(sid, 0, ())]]
        assert not verified.request.proposal.token_ids, "the item as last sent: no proposal"
        assert verified.verdict is not None and verified.verdict.accepted_count == 0
        assert w.pool.targets.failures(target.endpoint) == 0


async def test_a_refused_proposals_retry_still_asks_for_logprobs_and_features():
    """The retry at gamma 0 is the same item without its proposal: a session reporting logprobs (or relaying
    the target's features to the feature head) still gets them, so the round does not fail for lack of them."""
    async with pool_of_fakes(targets=1) as w:
        (target,) = w.targets.values()
        session = await new_session(w)
        target.refuse_next(errors.InvalidArgument("token 100000 is outside the vocabulary"))
        item = item_for(session, [100000, 3], top_logprobs=2, features=FeatureAsk(0, False, 0))

        verified = await w.pool.verify(session, item)

        assert not verified.request.proposal.token_ids
        assert verified.request.top_logprobs == 2 and verified.request.features == FeatureAsk(0, False, 0)
        verdict = verified.verdict
        assert verdict is not None and len(verdict.logprobs) == len(verdict.committed_token_ids) == 1


async def test_a_whole_call_refused_for_its_proposal_is_sent_again_at_gamma_0():
    async with pool_of_fakes(targets=1) as w:
        (target,) = w.targets.values()
        session = await new_session(w)
        target.fail_next(errors.InvalidArgument("a malformed distribution"))

        verified = await w.pool.verify(session, item_for(session, [1, 2]))

        assert [call[0][2] for call in target.calls] == [(1, 2), ()]
        assert verified.verdict is not None and w.pool.targets.failures(target.endpoint) == 0


async def test_an_item_refused_without_a_proposal_is_the_sessions_own_error():
    async with pool_of_fakes(targets=1) as w:
        (target,) = w.targets.values()
        session = await new_session(w)
        target.refuse_next(errors.InvalidArgument("the session's settings are refused"))

        verified = await w.pool.verify(session, item_for(session))

        assert len(target.calls) == 1, "nothing to drop: not sent again"
        assert isinstance(verified.error, errors.InvalidArgument)


async def test_when_every_target_is_down_the_round_fails_unavailable():
    async with pool_of_fakes(targets=2, all_down_wait_s=0) as w:
        session = await new_session(w)
        for target in w.targets.values():
            target.fail_next(errors.Unavailable("down"))

        with pytest.raises(errors.Unavailable, match="no target replica"):
            await w.pool.verify(session, item_for(session))

        assert sorted(len(t.calls) for t in w.targets.values()) == [1, 1]
        assert not any(w.pool.targets.is_up(ep) for ep in w.targets)


async def test_a_draft_failure_leaves_the_round_without_a_proposal_and_opens_the_breaker_once():
    async with pool_of_fakes(drafts=1) as w:
        (draft,) = w.drafts.values()
        first, second = await new_session(w), await new_session(w)
        draft.fail_next(errors.Unavailable("down"))
        before = failures_counted("draft")

        proposed = await w.pool.propose(first, 3)

        assert not proposed.token_ids and not proposed.from_call
        assert w.pool.drafts.failures(draft.endpoint) == 1 and failures_counted("draft") - before == 1
        # The replica backs off: the next session's round gets no proposal without a call.
        assert not (await w.pool.propose(second, 3)).token_ids
        assert len(draft.calls) == 1


async def test_a_draft_refusing_a_request_opens_no_breaker():
    async with pool_of_fakes(drafts=1) as w:
        (draft,) = w.drafts.values()
        first, second = await new_session(w), await new_session(w)
        draft.refuse_next(errors.InvalidArgument("this request is refused"))

        assert not (await w.pool.propose(first, 3)).token_ids
        assert w.pool.drafts.is_up(draft.endpoint)
        proposed = await w.pool.propose(second, 3)
        assert list(proposed.token_ids) == continuation(second.token_ids, 3)
        assert proposed.from_call


async def test_a_draft_that_lost_the_session_is_sent_every_token_again():
    async with pool_of_fakes(drafts=1) as w:
        (draft,) = w.drafts.values()
        session = await new_session(w)
        await w.pool.propose(session, 2)
        verdict = (await w.pool.verify(session, item_for(session))).verdict
        assert verdict is not None
        session.apply_verdict(verdict)
        draft.forget(session.session_id)  # a restarted draft

        proposed = await w.pool.propose(session, 2)

        sid = session.session_id
        assert draft.calls[1:] == [[(sid, 4, 2)], [(sid, 0, 2)]], (
            "the new token alone, refused; then everything"
        )
        assert list(proposed.token_ids) == continuation(session.token_ids, 2)
        assert w.pool.drafts.is_up(draft.endpoint)


async def test_a_failed_propose_batch_opens_the_draft_breaker_once_for_all_its_sessions():
    async with pool_of_fakes(drafts=1, draft_max_batch_size=3) as w:
        (draft,) = w.drafts.values()
        sessions = [await new_session(w) for _ in range(3)]
        draft.fail_next(errors.Unavailable("down"))
        before = failures_counted("draft")

        proposals = await asyncio.gather(*(w.pool.propose(s, 3) for s in sessions))

        assert [len(call) for call in draft.calls] == [3], "one ProposeBatch call carried all three"
        assert all(not p.token_ids for p in proposals)
        assert w.pool.drafts.failures(draft.endpoint) == 1 and failures_counted("draft") - before == 1


async def test_sessions_drafting_together_share_a_propose_batch_call():
    async with pool_of_fakes(drafts=1, draft_max_batch_size=3) as w:
        (draft,) = w.drafts.values()
        sessions = [await new_session(w, prompt=(i, i + 1)) for i in range(3)]

        proposals = await asyncio.gather(*(w.pool.propose(s, 2) for s in sessions))

        assert [len(call) for call in draft.calls] == [3]
        for s, p in zip(sessions, proposals, strict=True):
            assert list(p.token_ids) == continuation(s.token_ids, 2) and p.from_call
