"""The cost model: the speedup formula, the decaying least-squares fits, and round-time predictions."""

from __future__ import annotations

import math
import random

import pytest

from specserve.coordinator.fleet.limits import median_curve
from specserve.coordinator.speculation.cost_model import (
    CostModel,
    CostPrior,
    DecayingLeastSquares,
    _solve_linear,
    expected_tokens_iid,
    predicted_speedup,
)

pytestmark = pytest.mark.unit

# ---- the essay's formulas -----------------------------------------------------------------------


def test_expected_tokens_matches_the_essay_and_the_sum() -> None:
    # "With alpha equal to 0.8 and gamma equal to four, that sum is 3.3616."
    assert expected_tokens_iid(0.8, 4) == pytest.approx(3.3616, abs=1e-12)
    for alpha in (0.0, 0.3, 0.69, 0.99, 1.0):
        for gamma in range(10):
            assert expected_tokens_iid(alpha, gamma) == pytest.approx(sum(alpha**k for k in range(gamma + 1)))
    assert expected_tokens_iid(1.0, 7) == 8.0
    assert expected_tokens_iid(0.0, 7) == 1.0


@pytest.mark.parametrize(("alpha", "gamma"), [(-0.1, 1), (1.1, 1), (0.5, -1)])
def test_expected_tokens_rejects_nonsense(alpha: float, gamma: int) -> None:
    with pytest.raises(ValueError):
        expected_tokens_iid(alpha, gamma)


def test_predicted_speedup_matches_the_essay_example() -> None:
    # 10 ms target step, 1 ms per draft token, verifying 4 proposals + 1 costs 12 ms:
    # 16 ms per round for 3.3616 tokens, "about 2.1 times".
    speedup = predicted_speedup(0.8, 4, 1e6, 12e6, 10e6)
    assert speedup == pytest.approx(3.3616 * 10 / 16)
    assert 2.05 < speedup < 2.15
    # A callable verify cost is evaluated at gamma + 1 positions.
    seen: list[int] = []

    def verify(k: int) -> float:
        seen.append(k)
        return 10e6 + 0.5e6 * (k - 1)

    assert predicted_speedup(0.8, 4, 1e6, verify, 10e6) == pytest.approx(speedup)
    assert seen == [5]


def test_predicted_speedup_edges() -> None:
    # gamma = 0 is target-only decoding: speedup 1 when verifying one position costs a step.
    assert predicted_speedup(0.5, 0, 1e6, 10e6, 10e6) == pytest.approx(1.0)
    # A draft as expensive as the target never pays, whatever the acceptance below 1.
    for alpha in (0.0, 0.5, 0.9, 0.99):
        for gamma in range(1, 9):
            assert predicted_speedup(alpha, gamma, 10e6, lambda k: 10e6, 10e6) < 1.0
    with pytest.raises(ValueError):
        predicted_speedup(0.5, 2, 1e6, 0.0, 10e6)
    with pytest.raises(ValueError):
        predicted_speedup(0.5, 2, 1e6, 10e6, 0.0)


# ---- the linear solver and the decaying fit ----------------------------------------------------


def test_solve_linear_matches_elimination_on_random_spd_systems() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 4):
        for _ in range(50):
            m = [[rng.gauss(0, 1) for _ in range(n)] for _ in range(n)]
            a = [
                [sum(m[i][k] * m[j][k] for k in range(n)) + (0.1 if i == j else 0.0) for j in range(n)]
                for i in range(n)
            ]
            x_true = [rng.gauss(0, 1) for _ in range(n)]
            b = [sum(a[i][j] * x_true[j] for j in range(n)) for i in range(n)]
            x = _solve_linear(a, b)
            assert x is not None
            assert x == pytest.approx(x_true, rel=1e-6, abs=1e-6)
    assert _solve_linear([[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]) is None
    assert _solve_linear([[0.0]], [1.0]) is None


def test_fit_recovers_coefficients_from_varied_data() -> None:
    fit = DecayingLeastSquares(3, decay=0.98, prior_rows=[((1.0, 1.0, 1.0), 100.0, 1e-6)])
    for b in range(1, 9):
        for p in range(b, 5 * b):
            fit.add((1.0, b, p), 7.0 + 2.0 * b + 0.5 * p)
    assert fit.coef == pytest.approx((7.0, 2.0, 0.5), rel=1e-4)
    assert fit.predict((1.0, 3.0, 10.0)) == pytest.approx(18.0, rel=1e-4)


def test_fit_forgets_old_data() -> None:
    fit = DecayingLeastSquares(1, decay=0.9)
    for _ in range(100):
        fit.add((1.0,), 10.0)
    for _ in range(100):
        fit.add((1.0,), 20.0)
    # 0.9**100 ~ 3e-5 of the weight is left on the old regime.
    assert fit.coef[0] == pytest.approx(20.0, rel=1e-3)
    assert fit.weight == pytest.approx((1 - 0.9**200) / 0.1)
    assert fit.n_observations == 200


def test_fit_keeps_coefficients_non_negative() -> None:
    # Data that a free fit would explain with a negative slope: y = 10 - x.
    fit = DecayingLeastSquares(2, decay=1.0)
    for x in range(1, 6):
        fit.add((1.0, float(x)), 10.0 - x)
    c0, c1 = fit.coef
    assert c1 == 0.0
    assert c0 == pytest.approx(7.0)  # the mean, the best constant


def test_fit_uses_prior_rows_where_data_cannot_separate_coefficients() -> None:
    # Every observation has x = (1, 1): only c0 + c1 is identified; the prior row says c1 = 0.25 c0.
    fit = DecayingLeastSquares(2, decay=0.98, prior_rows=[((-0.25, 1.0), 0.0, 0.5)])
    for _ in range(30):
        fit.add((1.0, 1.0), 10.0)
    c0, c1 = fit.coef
    assert c0 + c1 == pytest.approx(10.0, rel=1e-3)
    assert c1 == pytest.approx(0.25 * c0, rel=1e-3)


def test_fit_validates() -> None:
    with pytest.raises(ValueError):
        DecayingLeastSquares(5, decay=0.9)
    with pytest.raises(ValueError):
        DecayingLeastSquares(1, decay=0.0)
    fit = DecayingLeastSquares(2, decay=0.9)
    with pytest.raises(ValueError):
        fit.add((1.0,), 1.0)
    with pytest.raises(ValueError):
        fit.add((1.0, 2.0), math.nan)


# ---- the cost model -----------------------------------------------------------------------------


def _true_verify(b: int, p: int) -> float:
    return 6e6 + 0.4e6 * b + 0.3e6 * p


def test_cost_model_learns_costs_from_noisy_calls() -> None:
    """Multiplicative log-normal noise (sigma 5%), 400 calls of each kind, seed 0."""
    rng = random.Random(0)
    cm = CostModel()
    assert not cm.ready
    for _ in range(400):
        g = rng.choice((1, 2, 3, 4, 6, 8))
        b = rng.randint(1, 8)
        noise = math.exp(rng.gauss(0, 0.05))
        cm.observe_draft(tokens=g, ns=int(0.8e6 * g * noise), prefill_tokens=0)
        cm.observe_verify(batch_size=b, positions=b * (g + 1), ns=int(_true_verify(b, b * (g + 1)) * noise))
        cm.observe_rtt(ns=int(0.4e6 * noise), tokens=g)
    assert cm.ready
    assert cm.draft_ns_per_token() == pytest.approx(0.8e6, rel=0.03)
    assert cm.verify_ns_per_position() == pytest.approx(0.3e6, rel=0.1)
    for b, p in ((1, 1), (1, 5), (4, 12), (8, 72)):
        assert cm.verify_ns(b, p) == pytest.approx(_true_verify(b, p), rel=0.05)
    assert cm.rtt_ns(3) == pytest.approx(0.4e6, rel=0.05)


@pytest.mark.parametrize("report_passes", [True, False], ids=["passes-reported", "depth-only"])
def test_tree_calls_expansion_passes_are_fitted_apart_from_the_chains_tokens(report_passes: bool) -> None:
    """A head that drafts chains at 5 ms a token and, one call in four, expands a tree in 1-3 more passes of 12 ms
    each (seed 0, 5% noise, 300 calls): with the passes reported the fit gives each its own cost, and a chain
    round is priced at 5 ms a token. Priced by depth alone (what the coordinator did before the draft reported its
    passes), the X"""
    rng = random.Random(0)
    cm = CostModel()
    for _ in range(300):
        depth = rng.choice((2, 4, 6, 8))
        passes = rng.choice((1, 2, 3)) if rng.random() < 0.25 else 0
        ns = (5e6 * depth + 12e6 * passes) * math.exp(rng.gauss(0, 0.05))
        cm.observe_draft(tokens=depth, ns=int(ns), expansion_passes=passes if report_passes else 0)
    if report_passes:
        assert cm.draft_ns_per_token() == pytest.approx(5e6, rel=0.03)
        assert cm.expansion_pass_ns() == pytest.approx(12e6, rel=0.1)
        assert cm.draft_ns(6, expansion_passes=2) == pytest.approx(54e6, rel=0.05)
    else:
        assert cm.draft_ns_per_token() > 1.1 * 5e6
        assert cm.expansion_pass_ns() == pytest.approx(2.0 * cm.draft_ns_per_token(), rel=0.01)  # the prior's ratio
    assert cm.snapshot()["draft_expansion_pass_ns"] == cm.expansion_pass_ns()


def test_round_ns_is_the_documented_sum_of_parts() -> None:
    cm = CostModel()
    for g in (1, 2, 4):
        cm.observe_draft(tokens=g, ns=int(1e6 * g))
        cm.observe_verify(batch_size=2, positions=2 * (g + 1), ns=int(_true_verify(2, 2 * (g + 1))))
        cm.observe_rtt(ns=500_000, tokens=g)
    for b in (1, 3, 16):
        assert cm.round_ns(0, b) == pytest.approx(cm.rtt_ns(0) + cm.verify_ns(b, b))
        assert cm.target_step_ns(b) == cm.round_ns(0, b)
        for g in (1, 3, 8):
            parts = 2 * cm.rtt_ns(g) + cm.draft_ns(g) + cm.verify_ns(b, b * (g + 1))
            assert cm.round_ns(g, b) == pytest.approx(parts)
    with pytest.raises(ValueError):
        cm.round_ns(-1, 1)
    with pytest.raises(ValueError):
        cm.round_ns(1, 0)


def test_target_only_rounds_of_several_steps_share_the_calls_fixed_part() -> None:
    """Per token, a target-only call of k steps costs its fixed part (the round trip and the Verify's time
    outside its passes) once and the rest k times: fixed / k + (round(0) - fixed); one step is round(0)."""
    cm = CostModel()
    for g in (0, 1, 2, 4):
        for _ in range(5):
            ns = int(_true_verify(1, g + 1))
            cm.observe_verify(batch_size=1, positions=g + 1, ns=ns)
            cm.observe_call_overhead(ns=ns, forward_ns=ns - 3_000_000)
            cm.observe_rtt(ns=2_000_000, tokens=g)
    one = cm.round_ns(0, 1)
    assert cm.verify_call_overhead_ns() == pytest.approx(3_000_000)
    assert cm.snapshot()["verify_call_overhead_ns"] == pytest.approx(3_000_000)
    fixed = cm.rtt_ns(0) + 3_000_000
    assert cm.target_only_token_ns(1, 1) == pytest.approx(one)
    for k in (2, 4, 16):
        assert cm.target_only_token_ns(1, k) == pytest.approx(fixed / k + one - fixed)
        assert cm.target_only_token_ns(1, k) < cm.target_only_token_ns(1, k // 2)
    with pytest.raises(ValueError):
        cm.target_only_token_ns(1, 0)
    with pytest.raises(ValueError):
        cm.observe_call_overhead(ns=-1, forward_ns=0)


def test_several_steps_per_call_never_amortise_the_forward_pass() -> None:
    """A one-position pass is mostly fixed cost (the verify fit's intercept v0), and each step of a call pays
    it again: however many steps a call takes, a token never costs less than the call's time in passes.
    (Amortising v0 over the steps priced gamma 0 at 25 ms/token on the default pair where it ran 58, and
    the policy then refused every draft.)"""
    cm = CostModel()
    pass_ns = 50_000_000
    for g in (0, 1, 2, 4):
        for _ in range(5):
            ns = int(pass_ns * (1 + 0.1 * g)) + 2_000_000
            cm.observe_verify(batch_size=1, positions=g + 1, ns=ns)
            cm.observe_call_overhead(ns=ns, forward_ns=ns - 2_000_000)
            cm.observe_rtt(ns=1_000_000, tokens=g)
    per_pass = cm.verify_ns(1, 1) - cm.verify_call_overhead_ns()
    assert cm.snapshot()["verify_fixed_ns"] > 0.5 * per_pass  # the intercept carries most of the pass
    for k in (1, 2, 8, 64):
        assert cm.target_only_token_ns(1, k) >= per_pass
    # Before any call's overhead is known, nothing is amortised beyond the round trip and the wait.
    fresh = CostModel()
    fresh.observe_verify(batch_size=1, positions=1, ns=pass_ns)
    fresh.observe_rtt(ns=1_000_000)
    assert fresh.target_only_token_ns(1, 8) == pytest.approx(
        fresh.rtt_ns(0) / 8 + fresh.verify_ns(1, 1)
    )


def test_the_batcher_wait_is_learnt_per_kind_and_batch_size_class() -> None:
    """Rounds at gamma 0 wait 2 ms in batches of 2-3; drafted ones wait 80 ms there (they come back
    from the draft after the pass left). Round costs carry the wait of their kind and class; a
    drafted round is taken to wait at least as long as an undrafted one (no data of its own, or
    less measured at another time)."""
    cm = CostModel()
    assert cm.queue_ns(4, drafted=True) == 0.0
    for _ in range(50):
        cm.observe_queue(drafted=False, batch_size=2, ns=2_000_000)
        cm.observe_queue(drafted=False, batch_size=5, ns=3_000_000)
    for _ in range(3):
        cm.observe_queue(drafted=True, batch_size=3, ns=80_000_000)
    assert cm.queue_ns(2, drafted=False) == pytest.approx(2e6)
    assert cm.queue_ns(3, drafted=True) == pytest.approx(80e6)  # 2 and 3: one class
    assert cm.queue_ns(6, drafted=True) == pytest.approx(3e6)  # no drafted data for 4-7 yet
    assert cm.queue_ns(1, drafted=True) == 0.0
    for _ in range(50):
        cm.observe_queue(drafted=True, batch_size=8, ns=1_000_000)
        cm.observe_queue(drafted=False, batch_size=8, ns=400_000_000)
    assert cm.queue_ns(8, drafted=True) == pytest.approx(400e6)  # never below the undrafted wait
    cm.observe_draft(tokens=1, ns=1_000_000)
    cm.observe_verify(batch_size=2, positions=2, ns=60_000_000)
    without_wait = 2 * cm.rtt_ns(1) + cm.draft_ns(1) + cm.verify_ns(2, 4)
    assert cm.round_ns(1, 2) == pytest.approx(without_wait + 80e6)
    assert cm.round_ns(1, 2, drafted=False) == pytest.approx(
        without_wait - cm.draft_ns(1) - cm.rtt_ns(1) + 2e6
    )
    assert cm.round_ns(0, 2) == pytest.approx(cm.rtt_ns(0) + cm.verify_ns(2, 2) + 2e6)
    with pytest.raises(ValueError):
        cm.observe_queue(drafted=True, batch_size=0, ns=1)


def test_prior_answers_before_data_and_yields_to_it() -> None:
    prior = CostPrior(verify_step_ns=20e6, draft_token_ns=2e6)
    cm = CostModel(prior=prior)
    assert cm.verify_ns(1, 1) == pytest.approx(20e6, rel=1e-6)
    assert cm.draft_ns_per_token() == pytest.approx(2e6, rel=1e-6)
    assert cm.rtt_ns(4) == 0.0
    cm.observe_draft(tokens=3, ns=1_500_000)
    cm.observe_verify(batch_size=1, positions=4, ns=5_000_000)
    assert cm.draft_ns_per_token() == pytest.approx(0.5e6, rel=1e-3)
    assert cm.verify_ns(1, 4) == pytest.approx(5e6, rel=1e-3)


def test_prior_ratios_fill_in_what_one_gamma_cannot_tell() -> None:
    """One session at one gamma feeds 4 positions every time: the slope comes from the prior ratio."""
    cm = CostModel()
    for _ in range(50):
        cm.observe_verify(batch_size=1, positions=4, ns=8_000_000)
    v0, vb, vp = (
        cm.snapshot()[k] for k in ("verify_fixed_ns", "verify_ns_per_item", "verify_ns_per_position")
    )
    assert cm.verify_ns(1, 4) == pytest.approx(8e6, rel=1e-3)
    assert vb == pytest.approx(cm.prior.per_item_ratio * v0, rel=0.05)
    assert vp == pytest.approx(cm.prior.per_position_ratio * (v0 + vb), rel=0.05)


def test_estimates_scale_with_the_machine() -> None:
    """The prior is stated in ratios, so a machine twice as slow gets estimates twice as large."""
    fast, slow = CostModel(), CostModel()
    for cm, k in ((fast, 1), (slow, 2)):
        for g in (2, 2, 3, 3, 2):
            cm.observe_draft(tokens=g, ns=k * 700_000 * g)
            cm.observe_verify(batch_size=1, positions=g + 1, ns=k * (9_000_000 + 400_000 * g))
            cm.observe_rtt(ns=k * 300_000, tokens=g)
    for g in range(9):
        for b in (1, 5):
            assert slow.round_ns(g, b) == pytest.approx(2 * fast.round_ns(g, b), rel=1e-3)


def test_observations_are_validated() -> None:
    cm = CostModel()
    with pytest.raises(ValueError):
        cm.observe_verify(batch_size=0, positions=1, ns=1)
    with pytest.raises(ValueError):
        cm.observe_verify(batch_size=2, positions=1, ns=1)
    with pytest.raises(ValueError):
        cm.observe_draft(tokens=-1, ns=1)
    with pytest.raises(ValueError):
        cm.observe_rtt(ns=1, tokens=-1)
    # A draft call that drafted nothing and fed nothing carries no information.
    cm.observe_draft(tokens=0, ns=123)
    assert not cm.ready
    with pytest.raises(ValueError):
        CostPrior(verify_step_ns=0)


def test_learnt_speedup_is_the_formula_with_learnt_costs() -> None:
    cm = CostModel()
    for _ in range(20):
        for g in (1, 2, 4, 8):
            cm.observe_draft(tokens=g, ns=1_000_000 * g)
            cm.observe_verify(batch_size=1, positions=g + 1, ns=10_000_000 + 500_000 * g)
            cm.observe_rtt(ns=0, tokens=g)
    for alpha in (0.3, 0.8):
        for g in (0, 1, 4, 8):
            expected = predicted_speedup(
                alpha, g, cm.draft_ns_per_token(), lambda k: cm.verify_ns(1, k), cm.verify_ns(1, 1)
            )
            assert cm.predicted_speedup(alpha, g) == pytest.approx(expected, rel=1e-6)
    # The essay's example in these units: 4 proposals at 0.8 with 1 ms drafts and a 12 ms verify of 5.
    assert cm.predicted_speedup(0.8, 4) == pytest.approx(3.3616 * 10 / 16, rel=2e-3)


# ---- the step of a multi-position pass, and the target's measured curve -------------------------

#: The default target's verify pass over k = 1..9 positions on the development machine, as ratios to one
#: position (specserve/target/calibration.py), at a 63 ms step.
CPU_CURVE = tuple(63e6 * r for r in (1.0, 1.7, 2.0, 1.9, 1.9, 1.9, 2.0, 1.9, 2.0))


def test_a_measured_curve_is_the_prior_before_any_data() -> None:
    cm = CostModel(prior=CostPrior(verify_curve=CPU_CURVE))
    assert cm.verify_ns(1, 1) == pytest.approx(CPU_CURVE[0], rel=0.02)
    for k in range(2, 10):  # a line plus a step fitted to the curve's shape
        assert cm.verify_ns(1, k) == pytest.approx(CPU_CURVE[k - 1], rel=0.08)
    assert cm.snapshot()["verify_multi_position_ns"] > 0.5 * CPU_CURVE[0]


@pytest.mark.parametrize("only_k", [1, 2, 5])
def test_a_session_held_at_one_gamma_knows_the_others_from_the_curve(only_k: int) -> None:
    """60 calls all feeding ``only_k`` positions, on a machine 1.5x slower than when the curve was measured:
    the data sets the scale, the curve the shape: within 15% at every k (the measured curve itself scatters
    by up to 9% about the line plus step the model fits to it)."""
    cm = CostModel(prior=CostPrior(verify_curve=CPU_CURVE))
    for _ in range(60):
        cm.observe_verify(batch_size=1, positions=only_k, ns=int(1.5 * CPU_CURVE[only_k - 1]))
    for k in (1, 2, 3, 5, 9):
        assert cm.verify_ns(1, k) == pytest.approx(1.5 * CPU_CURVE[k - 1], rel=0.15)


def test_a_curve_is_validated() -> None:
    with pytest.raises(ValueError):
        CostPrior(verify_curve=(10e6, 0.0))
    with pytest.raises(ValueError):
        CostPrior(verify_curve=(math.inf,))
    with pytest.raises(ValueError):
        CostPrior(curve_weight=-1.0)


def test_the_median_curve_of_several_targets() -> None:
    """The coordinator's prior from several targets' curves (specserve/coordinator/fleet/limits.py)."""
    assert median_curve([]) == () and median_curve([(), ()]) == ()
    assert median_curve([(10, 20, 30), (), (12, 18, 33, 40), (11, 25, 31)]) == (11.0, 20.0, 31.0)
