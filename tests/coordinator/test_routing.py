"""Consistent hashing of sessions over replicas, and the per-replica circuit breaker."""

from __future__ import annotations

import pytest

from coordinator.routing import HashRing, ReplicaSet

pytestmark = pytest.mark.unit

EPS = [f"10.0.0.{i}:50052" for i in range(1, 5)]
KEYS = [f"session-{i}" for i in range(2000)]


class FakeClock:
    """A settable clock (fake: a test controls time instead of sleeping)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_preference_lists_every_endpoint_once_and_is_stable():
    ring = HashRing(EPS)
    for key in KEYS[:50]:
        pref = ring.preference(key)
        assert sorted(pref) == sorted(EPS)
        assert HashRing(list(reversed(EPS))).preference(key) == pref  # independent of listing order


def test_load_is_spread_over_replicas():
    ring = HashRing(EPS)
    homes = [ring.preference(k)[0] for k in KEYS]
    for ep in EPS:
        assert 0.15 < homes.count(ep) / len(KEYS) < 0.35


def test_removing_a_replica_moves_only_its_sessions():
    full, smaller = HashRing(EPS), HashRing(EPS[:-1])
    moved = 0
    for key in KEYS:
        before, after = full.preference(key)[0], smaller.preference(key)[0]
        if before != EPS[-1]:
            assert after == before
        else:
            moved += 1
            assert after == full.preference(key)[1]  # the next replica on its ring
    assert moved > 0


def test_ring_rejects_bad_endpoint_lists():
    with pytest.raises(ValueError):
        HashRing([])
    with pytest.raises(ValueError):
        HashRing(["a:1", "a:1"])


def test_breaker_skips_a_failed_replica_then_retries_it_after_backoff():
    clock = FakeClock()
    replicas = ReplicaSet(EPS, base_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    key = KEYS[0]
    home = replicas.choose(key)
    assert replicas.mark_failed(home) == 1.0
    second = replicas.choose(key)
    assert second != home and second == HashRing(EPS).preference(key)[1]
    clock.now += 1.01
    assert replicas.choose(key) == home  # back-off over: home is tried again
    assert replicas.mark_failed(home) == 2.0  # consecutive failures double the back-off
    assert replicas.mark_failed(home) == 4.0
    assert replicas.mark_failed(home) == 4.0  # capped
    assert replicas.failures(home) == 4
    replicas.mark_ok(home)
    assert replicas.failures(home) == 0 and replicas.choose(key) == home


def test_all_down_gives_none_and_empty_set_gives_none():
    clock = FakeClock()
    replicas = ReplicaSet(EPS[:2], clock=clock)
    for ep in EPS[:2]:
        replicas.mark_failed(ep)
    assert replicas.choose("k") is None
    assert ReplicaSet([]).choose("k") is None
