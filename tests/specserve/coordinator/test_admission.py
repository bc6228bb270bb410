"""specserve.coordinator.admission: places under the session limits, and a token bucket of new sessions per client,
on a clock the test moves."""

from __future__ import annotations

import math

import pytest

from specserve.api import errors
from specserve.coordinator.admission import MIN_RETRY_AFTER_S, Admission, SessionRate, retry_hint_s

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_per_client():
    clock = Clock()
    rate = SessionRate(rate=2.0, burst=3, clock=clock)
    assert rate.wait_s("a", 3) == 0 and rate.wait_s("a", 4) == math.inf, "more than the burst never fits"
    for _ in range(3):
        assert rate.wait_s("a") == 0
        rate.take("a")
    assert rate.wait_s("a") == pytest.approx(0.5)
    assert rate.wait_s("b", 3) == 0, "another client has its own bucket"
    clock.now += 0.5
    assert rate.wait_s("a") == 0
    rate.take("a")
    clock.now += 1000
    assert rate.wait_s("a", 3) == 0, "refilled up to the burst"
    rate.take("a", 2)
    assert rate.wait_s("a", 2) == pytest.approx(0.5)


@pytest.mark.parametrize("rate, burst", [(0.0, 1), (-1.0, 1), (float("inf"), 1), (1.0, 0)])
def test_a_bucket_that_could_not_work_is_refused(rate, burst):
    with pytest.raises(ValueError):
        SessionRate(rate=rate, burst=burst)


@pytest.mark.parametrize(
    "wait_s, hint",
    [(0.05, 0.05), (0.0421, 0.043), (1e-9, MIN_RETRY_AFTER_S), (0.0, MIN_RETRY_AFTER_S), (2.5, 2.5), (0.0500000001, 0.05)],
)
def test_a_retry_hint_is_the_wait_rounded_up_to_the_millisecond_and_never_zero(wait_s, hint):
    assert retry_hint_s(wait_s) == pytest.approx(hint)


def test_the_rate_limits_retry_hint_is_the_buckets_real_wait_never_zero():
    """At 20 sessions a second the next session fits 50 ms after the burst is spent; a caller refused
    1 us before that is told 1 ms, not 0.0 s (issue 54: 'retry in 0.0 s')."""
    clock = Clock()
    admission = Admission(max_sessions=100, max_sessions_per_client=100, rate=SessionRate(rate=20.0, burst=2, clock=clock))
    for place in admission.admit("a", 2):
        place.release()
    with pytest.raises(errors.ResourceExhausted) as info:
        admission.admit("a")
    assert info.value.retry_after_s == pytest.approx(0.05)
    assert "retry in 50 ms" in info.value.message and "20 per second" in info.value.message
    clock.now += 0.05 - 1e-6
    with pytest.raises(errors.ResourceExhausted) as info:
        admission.admit("a")
    assert info.value.retry_after_s == MIN_RETRY_AFTER_S and "retry in 1 ms" in info.value.message
    clock.now += info.value.retry_after_s  # waiting out the hint is enough
    admission.admit("a")[0].release()


def test_places_are_taken_all_or_none_and_given_back_once():
    admission = Admission(max_sessions=3, max_sessions_per_client=2, rate=SessionRate(rate=1e-3, burst=5))
    a = admission.admit("a", 2)
    assert admission.active == 2
    with pytest.raises(errors.ResourceExhausted, match="maximum of 2 concurrent"):
        admission.admit("a")
    with pytest.raises(errors.ResourceExhausted, match="maximum of 3 sessions"):
        admission.admit("b", 2)
    assert admission.active == 2, "a refused request holds nothing"
    a[0].release()
    a[0].release()  # a second release gives nothing back
    assert admission.active == 1
    with a[1]:
        pass
    assert admission.active == 0
    b = admission.admit("b", 2)  # b's refused n = 2 above spent none of its rate tokens
    for place in b:
        place.release()
    wide = Admission(max_sessions=10, max_sessions_per_client=10, rate=SessionRate(rate=1e-3, burst=5))
    with pytest.raises(errors.InvalidArgument, match="burst of 5"):
        wide.admit("c", 6)  # would never fit: not a retry later


def test_a_caller_without_a_name_is_limited_in_total_only():
    """None: no token, no certificate, no address keying (specserve/coordinator/clients.py): neither the per-client
    concurrency nor the per-client rate applies, only max_sessions."""
    admission = Admission(max_sessions=4, max_sessions_per_client=1, rate=SessionRate(rate=1e-3, burst=1))
    for _ in range(50):  # far past the burst of 1
        (place,) = admission.admit(None)
        place.release()
    held = admission.admit(None, 4)
    with pytest.raises(errors.ResourceExhausted, match="maximum of 4 sessions") as info:
        admission.admit(None)
    assert info.value.retry_after_s == 1.0
    for place in held:
        place.release()
