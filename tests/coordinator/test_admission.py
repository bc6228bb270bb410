"""coordinator.admission.SessionRate: a token bucket of new sessions per client, on a clock the test moves."""

from __future__ import annotations

import pytest

from coordinator.admission import SessionRate

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_per_client():
    clock = Clock()
    rate = SessionRate(rate=2.0, burst=3, clock=clock)
    assert rate.wait_s("a", 3) == 0 and rate.wait_s("a", 4) == pytest.approx(0.5)
    for _ in range(3):
        assert rate.wait_s("a") == 0
        rate.take("a")
    assert rate.wait_s("a") == pytest.approx(0.5)
    assert rate.wait_s("b", 3) == 0, "another client has its own bucket"
    clock.now += 0.5
    assert rate.wait_s("a") == 0
    rate.take("a")
    clock.now += 1000
    assert rate.wait_s("a", 3) == 0 and rate.wait_s("a", 4) == pytest.approx(0.5), "refilled up to the burst"


@pytest.mark.parametrize("rate, burst", [(0.0, 1), (-1.0, 1), (float("inf"), 1), (1.0, 0)])
def test_a_bucket_that_could_not_work_is_refused(rate, burst):
    with pytest.raises(ValueError):
        SessionRate(rate=rate, burst=burst)
