"""The target's start-up measurement of its verify pass (specserve/target/calibration.py)."""

from __future__ import annotations

import itertools

import pytest
import tiny_models

from specserve.engine.models import load_model
from specserve.target.calibration import measure_verify_curve

pytestmark = pytest.mark.unit


def test_the_curve_has_a_positive_time_per_number_of_positions(llama_target):
    curve = measure_verify_curve(llama_target, 5, repeats=1)
    assert len(curve) == 5 and all(isinstance(t, int) and t > 0 for t in curve)


def test_the_warm_up_sweep_is_dropped_and_each_point_is_the_median_of_its_repeats(llama_target):
    """A scripted clock: pass (sweep r, k positions) takes 1000 * k + r ns, the warm-up sweep (r = 0) 10**9.
    The passes themselves run on the real model."""
    durations = {}
    for r, k in itertools.product(range(4), range(1, 4)):
        durations[(r, k)] = 10**9 if r == 0 else 1000 * k + r
    order = iter([durations[key] for key in itertools.product(range(4), range(1, 4))])
    now = [0]

    def clock() -> int:  # called twice per pass: the start, then the start plus that pass's duration
        if clock.started is None:
            clock.started = now[0]
            return now[0]
        now[0] = clock.started + next(order)
        clock.started = None
        return now[0]

    clock.started = None
    curve = measure_verify_curve(llama_target, 3, repeats=3, clock=clock)
    assert curve == (1002, 2002, 3002)


def test_a_short_context_model_is_measured_within_its_context(tmp_path):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path, seed=3)
    model = load_model(target_dir, device="cpu", dtype="float32")
    model.model.config.max_position_embeddings = 16
    assert len(measure_verify_curve(model, 9, repeats=1)) == 9  # a context of 7 tokens, then up to 9 fed


def test_arguments_are_checked(llama_target):
    with pytest.raises(ValueError):
        measure_verify_curve(llama_target, 0)
    with pytest.raises(ValueError):
        measure_verify_curve(llama_target, 3, repeats=0)
