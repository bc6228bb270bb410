"""specserve.bench.timing: the one timer. A clock that advances by known steps stands in for time, so the
figures are exact (no timing assertion: what is checked is the arithmetic and which laps are kept)."""

from __future__ import annotations

import pytest

from specserve.bench.timing import Laps, Stopwatch

pytestmark = pytest.mark.unit


class StepClock:
    """A nanosecond clock that moves ``steps[i]`` ns on its i-th reading after the first."""

    def __init__(self, steps: list[int]) -> None:
        self.now, self.steps = 0, iter(steps)

    def __call__(self) -> int:
        value = self.now
        self.now += next(self.steps, 0)
        return value


def test_a_stopwatch_reads_its_clock_in_seconds():
    with Stopwatch(StepClock([2_000_000_000])) as sw:  # entered at 0; left 2 s later
        pass
    assert sw.seconds == 2.0


def test_a_stopwatch_not_started_says_so():
    with pytest.raises(RuntimeError, match="not started"):
        Stopwatch().elapsed()


def test_laps_keep_what_follows_the_warmup_and_give_medians_in_ms():
    # Three turns, the first a warm-up; each turn times "a" (1, 3, 5 ms) then "b" (10, 20, 40 ms).
    clock = StepClock([1_000_000, 0, 10_000_000, 0, 3_000_000, 0, 20_000_000, 0, 5_000_000, 0, 40_000_000, 0])
    laps = Laps(warmup=1, clock=clock)
    turns = []
    for i in laps.rounds(2):
        turns.append(i)
        with laps.time("a"):
            pass
        with laps.time("b"):
            pass
    assert turns == [0, 1, 2]
    assert laps.seconds == {"a": [0.003, 0.005], "b": [0.02, 0.04]}
    assert laps.median_ms("a") == pytest.approx(4.0) and laps.median_ms("b") == pytest.approx(30.0)


def test_a_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="warmup"):
        Laps(warmup=-1)
