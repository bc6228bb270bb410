"""Request domain objects: the sampling mode's table, its wire form and what it means for greedy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specserve.api.errors import InvalidArgument
from specserve.api.params import (
    DEFAULT_SAMPLING_MODE,
    MAX_TOP_LOGPROBS,
    SAMPLING_MODES,
    PositionLogprobs,
    SamplingParams,
    StopConditions,
    TokenLogprob,
    Verdict,
    check_top_logprobs,
    resolve_sampling_mode,
)
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit


def test_every_wire_sampling_mode_has_a_name_and_unspecified_is_the_default():
    named = {v for k, v in common_pb2.SamplingMode.items() if k != "SAMPLING_MODE_UNSPECIFIED"}
    assert set(SAMPLING_MODES.values()) == named
    assert resolve_sampling_mode(common_pb2.SAMPLING_MODE_UNSPECIFIED) == DEFAULT_SAMPLING_MODE == "optimal"
    for name, value in SAMPLING_MODES.items():
        assert resolve_sampling_mode(value) == name
    with pytest.raises(InvalidArgument, match="unknown sampling_mode 9"):
        resolve_sampling_mode(9)


@pytest.mark.parametrize("mode", sorted(SAMPLING_MODES))
def test_sampling_params_round_trip_the_wire_and_the_store_json(mode):
    params = SamplingParams(
        temperature=0.75, top_p=0.875, seed=2**63 + 1, sampling_mode=mode
    )  # exact in float32
    assert SamplingParams.from_pb(params.to_pb()) == params
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(params)))) == params


def test_a_record_written_before_sampling_modes_reads_as_optimal():
    old = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 3}
    assert SamplingParams(**old).sampling_mode == "optimal"


def test_coupled_is_a_property_of_sampled_decoding_only():
    assert SamplingParams(temperature=1.0, sampling_mode="coupled").coupled
    assert not SamplingParams(temperature=0.0, sampling_mode="coupled").coupled  # greedy: no noise at all
    assert not SamplingParams(temperature=1.0).coupled
    with pytest.raises(InvalidArgument, match="sampling_mode must be one of"):
        SamplingParams(sampling_mode="exact")


def test_logprobs_round_trip_the_wire_and_the_store_json():
    entry = PositionLogprobs(7, -0.5, (TokenLogprob(7, -0.5), TokenLogprob(2, -1.25)))
    assert PositionLogprobs.from_pb(entry.to_pb()) == entry
    assert PositionLogprobs.from_dict(json.loads(json.dumps(dataclasses.asdict(entry)))) == entry
    verdict = Verdict(1, (7, 3), False, 4, 10, 0, (entry, PositionLogprobs(3, -2.0)))
    assert Verdict.from_pb(verdict.to_pb()) == verdict
    assert Verdict.from_pb(Verdict(0, (3,), True, 1, 5).to_pb()).logprobs == ()


def test_top_logprobs_is_bounded_like_openais():
    assert check_top_logprobs(0) == 0 and check_top_logprobs(MAX_TOP_LOGPROBS) == MAX_TOP_LOGPROBS == 20
    with pytest.raises(InvalidArgument, match="top_logprobs must be in"):
        check_top_logprobs(21)


def test_min_new_tokens_is_bounded_by_max_new_tokens_and_refuses_stop_strings():
    stop = StopConditions(max_new_tokens=8, min_new_tokens=8, stop_token_ids=(5,))
    assert StopConditions.from_pb(stop.to_pb(), default_max_new_tokens=1) == stop
    with pytest.raises(InvalidArgument, match=r"min_new_tokens=9 must be in \[0, max_new_tokens=8\]"):
        StopConditions(max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(InvalidArgument, match="cannot be combined with stop strings"):
        StopConditions(min_new_tokens=2, stop_strings=("x",))


def test_masked_rows_counts_the_positions_before_the_minimum_and_stop_tokens_follow_ignore_eos():
    stop = StopConditions(min_new_tokens=5, stop_token_ids=(9,))
    assert [stop.masked_rows(generated, 3) for generated in (0, 3, 4, 5, 7)] == [3, 2, 1, 0, 0]
    assert stop.stop_tokens(frozenset({2})) == {2, 9}
    assert dataclasses.replace(stop, ignore_eos=True).stop_tokens(frozenset({2})) == {9}
