"""Session state: the one mutator emits each committed token once, and refuses a log that disagrees."""

from __future__ import annotations

import dataclasses

import pytest
from worker_fakes import speculator_for

from specserve.api.errors import FailedPrecondition
from specserve.api.params import (
    FINISH_REASONS,
    NOT_FINISHED,
    PROPOSER_KINDS,
    SamplingParams,
    StopConditions,
    Verdict,
)
from specserve.api.stats import GenerationStats, SourceStats
from specserve.coordinator.coordinator import generation_stats
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.servicer import stats_pb
from specserve.coordinator.session import Session, SessionStats, SessionStatus
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

PROMPT = (1, 2, 3)


def _session() -> Session:
    return Session(
        "s1",
        PROMPT,
        SamplingParams(temperature=0.0, seed=7),
        StopConditions(max_new_tokens=8),
        SpeculationSettings(gamma=2, proposer=common_pb2.PROPOSER_KIND_MODEL),
    )


def _verdict(tokens, committed_len, version, finish=0, accepted=0):
    return Verdict(accepted, tuple(tokens), False, version, committed_len, finish)


def test_verdicts_then_a_full_log_reread_emit_each_token_once():
    s = _session()
    assert s.apply_verdict(_verdict([4, 5], 5, 1)) == (4, 5)
    assert s.base.committed_len == 5 and s.version == 1
    # A re-read of the whole log (after a conflict) emits only what is new.
    assert s.advance((1, 2, 3, 4, 5, 6, 7), start=0, version=3, finish_reason=0) == (6, 7)
    assert s.generated_token_ids == (4, 5, 6, 7)
    # Re-reading the same log again emits nothing.
    assert s.advance((1, 2, 3, 4, 5, 6, 7), start=0, version=3, finish_reason=0) == ()
    assert s.stats.first_token_ns > 0


def test_a_log_that_disagrees_or_goes_back_is_refused():
    s = _session()
    s.apply_verdict(_verdict([4, 5], 5, 1))
    with pytest.raises(FailedPrecondition):
        s.advance((1, 2, 3, 9), start=0, version=2, finish_reason=0)
    with pytest.raises(FailedPrecondition):
        s.advance((1, 2, 3, 4, 5), start=0, version=0, finish_reason=0)
    with pytest.raises(FailedPrecondition):
        s.apply_verdict(_verdict([6], 7, 2))  # starts at 6, beyond the 5 held
    assert s.token_ids == (1, 2, 3, 4, 5) and s.version == 1


def test_finish_reason_finishes_the_session():
    s = _session()
    s.apply_verdict(_verdict([4, 0], 5, 1, finish=common_pb2.FINISH_REASON_EOS))
    assert s.finished and s.status == SessionStatus.FINISHED
    s.end(SessionStatus.RUNNING)  # status never goes back
    assert s.status == SessionStatus.FINISHED
    pb = generation_stats(s)
    assert pb.completion_tokens == 2 and pb.finish_reason == "eos" and pb.seed == 7


def test_draft_sees_only_new_tokens_and_everything_after_a_switch():
    s = _session()
    assert s.unseen_by_draft("d1") == (0, PROMPT)
    s.draft_caught_up("d1")
    s.apply_verdict(_verdict([4, 5], 5, 1))
    assert s.unseen_by_draft("d1") == (3, (4, 5))
    assert s.unseen_by_draft("d2") == (0, (1, 2, 3, 4, 5))


def test_stats_count_acceptance_per_position():
    st = SessionStats()
    st.observe_round(proposed=3, accepted=2)
    st.observe_round(proposed=4, accepted=4)
    st.observe_round(proposed=0, accepted=0)
    assert st.rounds == 3 and st.proposed_tokens == 7 and st.accepted_tokens == 6
    assert st.accepted_per_position == [2, 2, 1, 1]
    assert st.draft_rounds == 2, 'a gamma = 0 round proposes nothing and is no draft'


def test_the_sessions_sources_follow_every_committed_token():
    """The prediction and the n-gram lookup see each committed token once, whichever way it arrived
    (a verdict, a re-read of the log), and the prediction's counts reach the statistics."""
    s = Session(
        "s2",
        PROMPT,
        SamplingParams(temperature=0.0),
        StopConditions(max_new_tokens=8),
        SpeculationSettings(gamma=2, proposer=common_pb2.PROPOSER_KIND_NGRAM),
    )
    speculator = speculator_for(s, prediction=(4, 5, 6, 7))
    assert [p.name for p in speculator.sources] == ["prediction", "ngram"]
    prediction, ngram = speculator.sources
    assert prediction.draft(2) == (4, 5)
    s.apply_verdict(_verdict([4, 9], 5, 1, accepted=1))
    s.advance((1, 2, 3, 4, 9, 1, 2), start=0, version=2, finish_reason=0)  # a re-read adds 1, 2
    assert ngram.draft(2) == (3, 4), "the lookup saw prompt, 4, 9, 1, 2"
    pb = generation_stats(s)
    assert (pb.accepted_prediction_tokens, pb.rejected_prediction_tokens) == (1, 1)
    plain = _session()
    assert speculator_for(plain).source("prediction") is None
    assert generation_stats(plain).accepted_prediction_tokens == 0


def test_each_source_has_a_row_and_the_wire_repeats_the_ngram_and_forced_rows():
    """``GenerationStats.sources`` per source by name (the SDK reads them); ``lookup_*`` and ``forced_*`` are the
    ``ngram`` and ``forced`` rows, for clients that predate them."""
    from specserve.client import GenerationStats as ClientStats

    s = _session()
    s.stats.observe_round(proposed=3, accepted=2, source="ngram")
    s.stats.observe_round(proposed=2, accepted=2, source="forced")
    s.stats.observe_round(proposed=4, accepted=1, source="model")
    s.stats.observe_round(proposed=0, accepted=0, source="model")  # gamma 0: no draft round
    pb = stats_pb(generation_stats(s))
    rows = {r.name: (r.draft_rounds, r.proposed_tokens, r.accepted_tokens) for r in pb.sources}
    assert rows == {"ngram": (1, 3, 2), "forced": (1, 2, 2), "model": (1, 4, 1)}
    assert sum(r.proposed_tokens for r in pb.sources) == pb.proposed_tokens == 9
    assert (pb.lookup_proposed_tokens, pb.lookup_accepted_tokens) == (3, 2)
    assert (pb.forced_proposed_tokens, pb.forced_accepted_tokens) == (2, 2)
    sdk = ClientStats.from_pb(pb)
    assert [(r.name, r.proposed_tokens, r.accepted_tokens) for r in sdk.sources] == [
        ("ngram", 3, 2),
        ("forced", 2, 2),
        ("model", 4, 1),
    ]
    assert sdk.sources[0].acceptance_rate == pytest.approx(2 / 3)


def test_the_closing_statistics_go_on_the_wire_field_by_field():
    """The shared ``GenerationStats`` has the wire message's fields by the same names; the servicer's
    conversion carries each value (``sources`` a row each, ``finish_reason`` and ``proposer`` their names'
    enum values), and the SDK's ``from_pb`` gives back the coordinator's statistics."""
    from specserve.v1 import coordinator_pb2

    wire = {f.name for f in coordinator_pb2.GenerationStats.DESCRIPTOR.fields}
    assert {f for f in GenerationStats.__dataclass_fields__} == wire
    row_fields = {f.name for f in coordinator_pb2.SourceStats.DESCRIPTOR.fields}
    assert set(SourceStats.__dataclass_fields__) == row_fields
    values = {name: i + 1 for i, name in enumerate(sorted(wire - {"session_id", "accepted_per_position", "sources"}))}
    values["finish_reason"], values["proposer"] = common_pb2.FINISH_REASON_STOP_STRING, common_pb2.PROPOSER_KIND_NGRAM
    stats = GenerationStats(
        session_id="s-1",
        accepted_per_position=(3, 1),
        sources=(SourceStats("ngram", 1, 2, 3), SourceStats("model", 4, 5, 6)),
        **{**values, "finish_reason": "stop_string", "proposer": "ngram"},
    )
    pb = stats_pb(stats)
    assert pb.session_id == "s-1" and list(pb.accepted_per_position) == [3, 1]
    assert {name: getattr(pb, name) for name in values} == values
    assert [(r.name, r.draft_rounds, r.proposed_tokens, r.accepted_tokens) for r in pb.sources] == [
        ("ngram", 1, 2, 3),
        ("model", 4, 5, 6),
    ]
    assert GenerationStats.from_pb(pb) == stats


@pytest.mark.parametrize("reason", [*FINISH_REASONS.values(), NOT_FINISHED])
@pytest.mark.parametrize("proposer", [*PROPOSER_KINDS.values(), common_pb2.PROPOSER_KIND_UNSPECIFIED])
def test_every_finish_reason_and_proposer_goes_out_as_its_enum_value(reason, proposer):
    """A session's ``FinishReason`` and ``ProposerKind`` reach the wire as the values the session held,
    through their names in the shared type."""
    s = _session()
    s.finish_reason = reason
    s.speculation = dataclasses.replace(s.speculation, proposer=proposer)
    pb = stats_pb(generation_stats(s))
    assert (pb.finish_reason, pb.proposer) == (reason, proposer)
