"""Consistent hashing of sessions over replicas, and the per-replica circuit breaker."""

from __future__ import annotations

import pytest

from specserve.coordinator.fleet.routing import HashRing, ReplicaSet, prefix_key

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


def test_prefix_key_is_the_first_tokens_only():
    turn1 = list(range(1, 80))
    turn2 = [*turn1, 500, 501, *range(200, 260)]
    assert prefix_key(turn1, 64) == prefix_key(turn2, 64)  # later turns resend the history: same key
    assert prefix_key(turn1, 64) != prefix_key([2, *turn1[1:]], 64)
    assert prefix_key(turn1[:10], 64) != prefix_key(
        turn1, 64
    )  # a prompt shorter than the key hashes what it has
    assert prefix_key(turn1, 0) is None


def test_the_prefix_key_stays_inside_a_cache_scope():
    """Issue 54: the routing key holds the session's cache scope, so one tenant's prompt is placed apart
    from another's (no replica is a guess at another tenant's prefix); one scope's turns keep one key."""
    from specserve.coordinator.cache_scope import cache_scope

    turn1 = list(range(1, 80))
    turn2 = [*turn1, 500, 501]
    a = cache_scope("token:a", None, mode="tenant")
    b = cache_scope("token:b", None, mode="tenant")
    assert prefix_key(turn1, 64, a) == prefix_key(turn2, 64, a) == prefix_key(list(turn1), 64, a)
    assert prefix_key(turn1, 64, a) != prefix_key(turn1, 64, b)
    assert prefix_key(turn1, 64, a) != prefix_key(turn1, 64)
    # Over many tenants, the same prompt's home replica is spread over the ring, not one replica.
    ring = HashRing(EPS)
    homes = {
        ring.preference(prefix_key(turn1, 64, cache_scope(f"token:{i}", None, mode="tenant")) or "")[0]
        for i in range(40)
    }
    assert len(homes) > 1
    # Shared mode: every tenant of a salt has one key; the salt still separates.
    shared = [cache_scope(t, "s", mode="shared") for t in ("token:a", "token:b", "anonymous")]
    assert len({prefix_key(turn1, 64, s) for s in shared}) == 1
    assert prefix_key(turn1, 64, shared[0]) != prefix_key(turn1, 64, cache_scope("token:a", "t", mode="shared"))


def test_two_coordinators_order_a_prefix_alike_and_failover_walks_the_order():
    a, b = ReplicaSet(EPS), ReplicaSet(list(reversed(EPS)))
    for key in KEYS[:50]:
        assert a.order(key, {}, factor=1.25) == b.order(key, {}, factor=1.25)
    clock = FakeClock()
    rs = ReplicaSet(EPS, clock=clock)
    order = rs.order("k", {}, factor=1.25)
    rs.mark_failed(order[0])
    assert rs.first_up(order) == order[1]


def test_bounded_load_passes_over_a_replica_with_more_than_its_share():
    rs = ReplicaSet(EPS)
    preference = list(rs.order("shared-system-prompt", {}, factor=1.25))
    loads: dict[str, int] = {}
    homes = []
    for _ in range(40):  # forty sessions with one key: spread, none over ceil(1.25 * n / 4)
        home = rs.order("shared-system-prompt", loads, factor=1.25)[0]
        loads[home] = loads.get(home, 0) + 1
        homes.append(home)
    assert homes[0] == preference[0]
    assert max(loads.values()) <= -(-1.25 * 40 // 4) and len(loads) == len(EPS)
    # Without load the key's own first replica.
    assert rs.order("shared-system-prompt", dict.fromkeys(EPS, 3), factor=1.25)[0] == preference[0]
