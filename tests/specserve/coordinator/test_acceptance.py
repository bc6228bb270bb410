"""The per-session acceptance tracker: exact counts, convergence, per-position estimates, change detection."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from specserve.coordinator.speculation.acceptance import AcceptanceTracker
from specserve.coordinator.speculation.cost_model import expected_tokens_iid

pytestmark = pytest.mark.unit


def _round(rng: random.Random, gamma: int, accept: Callable[[int], float]) -> int:
    """Accepted count of one simulated round: position i is accepted with probability accept(i)."""
    accepted = 0
    while accepted < gamma and rng.random() < accept(accepted + 1):
        accepted += 1
    return accepted


def test_exact_counts_of_one_round() -> None:
    t = AcceptanceTracker(prior_alpha=0.6, prior_weight=2.0, position_shrinkage=4.0)
    assert t.alpha() == pytest.approx(0.6)
    assert t.expected_tokens(3) == pytest.approx(expected_tokens_iid(0.6, 3))
    t.observe(proposed=3, accepted=1)
    # Position 1 reached and accepted, position 2 reached and rejected, position 3 not reached.
    pooled = (1 + 0.6 * 2) / (2 + 2)
    assert t.alpha() == pytest.approx(pooled)
    assert t.position_alpha(1) == pytest.approx((1 + 4 * pooled) / (1 + 4))
    assert t.position_alpha(2) == pytest.approx((0 + 4 * pooled) / (1 + 4))
    assert t.position_alpha(3) == pytest.approx(pooled)
    a1, a2, a3 = (t.position_alpha(i) for i in (1, 2, 3))
    assert t.expected_tokens(0) == 1.0
    assert t.expected_tokens(3) == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a3)
    assert t.last_accepted == 1
    assert t.rounds == 1


def test_a_round_without_speculation_teaches_and_forgets_nothing() -> None:
    t = AcceptanceTracker()
    for accepted in (4, 2, 4, 0, 3):
        t.observe(proposed=4, accepted=accepted)
    before = [t.expected_tokens(g) for g in range(9)]
    for _ in range(50):
        t.observe(proposed=0, accepted=0)
    assert [t.expected_tokens(g) for g in range(9)] == before
    assert t.rounds == 55


def test_converges_to_iid_acceptance() -> None:
    """i.i.d. acceptance 0.7, gamma 4, 3,000 rounds, seed 1: the estimate averaged over the last
    2,000 rounds is within 0.03 of 0.7 (its standard error is about 0.005: a window of ~33 rounds
    of ~2.8 positions, averaged over ~60 nearly independent windows), and expected_tokens(4) within 5%."""
    rng = random.Random(1)
    t = AcceptanceTracker()
    alphas, expected = [], []
    for r in range(3000):
        t.observe(proposed=4, accepted=_round(rng, 4, lambda i: 0.7))
        if r >= 1000:
            alphas.append(t.alpha())
            expected.append(t.expected_tokens(4))
    assert sum(alphas) / len(alphas) == pytest.approx(0.7, abs=0.03)
    assert sum(expected) / len(expected) == pytest.approx(expected_tokens_iid(0.7, 4), rel=0.05)


def test_tracks_acceptance_per_position() -> None:
    """Acceptance 0.95 at position 1 and 0.4 after it, gamma 3, 2,000 rounds, seed 2: averaged over
    the last 1,500 rounds the per-position estimates separate (0.95 vs 0.4, standard errors < 0.01)."""
    rng = random.Random(2)
    t = AcceptanceTracker()
    first, second = [], []
    for r in range(2000):
        t.observe(proposed=3, accepted=_round(rng, 3, lambda i: 0.95 if i == 1 else 0.4))
        if r >= 500:
            first.append(t.position_alpha(1))
            second.append(t.position_alpha(2))
    assert sum(first) / len(first) == pytest.approx(0.95, abs=0.04)
    assert sum(second) / len(second) == pytest.approx(0.4, abs=0.06)


def test_a_collapse_of_acceptance_is_believed_within_a_few_rounds() -> None:
    """20 seeds: 300 rounds at 0.9, then 0.1 (gamma 6). Without change detection the slow memory
    (half-life ~23 rounds) would still say > 0.5 after 15 rounds; with it every seed is below 0.5."""
    for seed in range(20):
        rng = random.Random(seed)
        t = AcceptanceTracker()
        for _ in range(300):
            t.observe(proposed=6, accepted=_round(rng, 6, lambda i: 0.9))
        assert t.alpha() > 0.8
        for _ in range(15):
            t.observe(proposed=6, accepted=_round(rng, 6, lambda i: 0.1))
        assert t.alpha() < 0.5, seed
        assert t.changes >= 1


def test_without_detection_the_same_collapse_takes_longer() -> None:
    """The control for the test above: detectors that never fire leave the estimate above 0.5."""
    rng = random.Random(0)
    t = AcceptanceTracker(fall_threshold=1e9, rise_threshold=1e9)
    for _ in range(300):
        t.observe(proposed=6, accepted=_round(rng, 6, lambda i: 0.9))
    for _ in range(15):
        t.observe(proposed=6, accepted=_round(rng, 6, lambda i: 0.1))
    assert t.alpha() > 0.5
    assert t.changes == 0


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9, 0.97])
def test_few_false_alarms_on_a_stationary_sequence(alpha: float) -> None:
    """2,000 stationary rounds at gamma 4, seed 3: at most 6 detected changes (measured 0-4)."""
    rng = random.Random(3)
    t = AcceptanceTracker()
    for _ in range(2000):
        t.observe(proposed=4, accepted=_round(rng, 4, lambda i: alpha))
    assert t.changes <= 6


def test_validates() -> None:
    t = AcceptanceTracker()
    with pytest.raises(ValueError):
        t.observe(proposed=2, accepted=3)
    with pytest.raises(ValueError):
        t.observe(proposed=-1, accepted=0)
    with pytest.raises(ValueError):
        t.position_alpha(0)
    with pytest.raises(ValueError):
        t.expected_tokens(-1)
    with pytest.raises(ValueError):
        AcceptanceTracker(decay=0.0)
    with pytest.raises(ValueError):
        AcceptanceTracker(prior_alpha=1.5)
    with pytest.raises(ValueError):
        AcceptanceTracker(fall_threshold=0.0)
