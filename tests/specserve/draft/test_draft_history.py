"""specserve.draft.history: what a draft knows of each session's committed tokens."""

from __future__ import annotations

import pytest

from specserve.api.errors import FailedPrecondition, NotFound
from specserve.draft.history import CommittedHistory

pytestmark = pytest.mark.unit


class FakeClock:
    """A manual monotonic clock (stands in for time passing)."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_resolve_appends_to_what_is_known():
    h = CommittedHistory(max_sessions=4, ttl_s=60)
    assert h.resolve("s", 0, [1, 2, 3]) == (1, 2, 3)
    with pytest.raises(FailedPrecondition, match="start_position=2"):
        h.resolve("s", 2, [3])  # nothing recorded yet
    h.record("s", (1, 2, 3))
    assert h.resolve("s", 3, [4, 5]) == (1, 2, 3, 4, 5)
    assert h.resolve("s", 1, [9]) == (1, 9)  # the caller's word wins for what it resends
    with pytest.raises(FailedPrecondition, match="knows 3 committed tokens"):
        h.resolve("s", 4, [5])


def test_lru_by_count_and_ttl():
    clock = FakeClock()
    h = CommittedHistory(max_sessions=2, ttl_s=10, clock=clock)
    h.record("a", (1,))
    h.record("b", (2,))
    h.record("a", (1, 5))  # a becomes most recently used
    assert h.record("c", (3,)) == ["b"]
    assert "b" not in h and h.known("a") == (1, 5)
    clock.now += 11
    assert sorted(h.record("d", (4,))) == ["a", "c"]
    assert len(h) == 1 and h.known("d") == (4,)


def test_release():
    h = CommittedHistory(max_sessions=2, ttl_s=10)
    h.record("a", (1,))
    h.release("a")
    assert h.known("a") == ()
    with pytest.raises(NotFound, match="'a'"):
        h.release("a")


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_sessions"):
        CommittedHistory(max_sessions=0, ttl_s=1)
    with pytest.raises(ValueError, match="ttl_s"):
        CommittedHistory(max_sessions=1, ttl_s=0)
