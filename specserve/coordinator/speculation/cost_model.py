"""Online estimates of what a speculative round costs, and the cost model's speedup bound.

One :class:`CostModel` per coordinator, shared by its sessions, learns draft time, verify time (by batch
size and positions), the network round trip and the wait in the Verify batcher from the timings of real
calls, each a decaying least-squares fit with a few prior rows that keep it well posed, and predicts a
round's wall time from them (:meth:`CostModel.round_ns`) for the policy. The formulas and the priors:
docs/design.md, "What the cost model learns". The module is pure Python: no torch, no gRPC, no logging.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CostModel",
    "CostPrior",
    "DecayingLeastSquares",
    "expected_tokens_iid",
    "predicted_speedup",
]


def expected_tokens_iid(alpha: float, gamma: int) -> float:
    """Expected committed tokens of a round with ``gamma`` proposals, i.i.d. acceptance ``alpha``.

    ``1 + alpha + ... + alpha**gamma = (1 - alpha**(gamma + 1)) / (1 - alpha)``: the
    accepted prefix plus the correction or bonus token (Leviathan et al. 2023,
    arXiv 2211.17192, eq. 1).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(
    alpha: float,
    gamma: int,
    draft_ns: float,
    verify_ns_of_positions: Callable[[int], float] | float,
    target_step_ns: float,
) -> float:
    """The cost model's speedup bound of speculation over target-only decoding.

    ``speedup = E[tokens] * T_target / (gamma * T_draft + T_verify(gamma + 1))`` with
    ``E[tokens] = (1 - alpha**(gamma+1)) / (1 - alpha)``.

    Args:
        alpha: per-token acceptance, in [0, 1].
        gamma: draft tokens per round (0 gives ``T_target / T_verify(1)``, about 1).
        draft_ns: time of one draft token.
        verify_ns_of_positions: time of verifying ``k`` positions in one pass, as a
            function of ``k`` (called with ``gamma + 1``), or that time for
            ``gamma + 1`` positions directly as a number.
        target_step_ns: time of one target-only decode step (the baseline's per-token cost).
    """
    if draft_ns < 0 or target_step_ns <= 0:
        raise ValueError("draft_ns must be >= 0 and target_step_ns > 0")
    if callable(verify_ns_of_positions):
        verify = float(verify_ns_of_positions(gamma + 1))
    else:
        verify = float(verify_ns_of_positions)
    if verify <= 0:
        raise ValueError("verify time must be > 0")
    return expected_tokens_iid(alpha, gamma) * target_step_ns / (gamma * draft_ns + verify)


class DecayingLeastSquares:
    """Non-negative weighted least squares ``y ~ x . theta`` with exponential forgetting.

    Minimises ``sum_i decay**(n - i) * (y_i - x_i . theta)**2 + sum_j w_j * (y_j - x_j . theta)**2``
    over ``theta >= 0``, where the second sum runs over constant prior rows
    ``(x_j, y_j, w_j)`` that never decay. The normal equations are solved in
    closed form; a coefficient that comes out negative is fixed at 0 and the
    rest re-solved (an active-set step, exact when at most one bound is active).
    Pure Python, solved lazily when a coefficient is read; at most 4 features.
    """

    def __init__(
        self,
        n_features: int,
        *,
        decay: float,
        prior_rows: Sequence[tuple[Sequence[float], float, float]] = (),
    ) -> None:
        if not 1 <= n_features <= 4:
            raise ValueError("n_features must be 1 to 4")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self._n = n_features
        self._decay = decay
        self._xx = [[0.0] * n_features for _ in range(n_features)]  # sum w x x^T of the data
        self._xy = [0.0] * n_features  # sum w x y of the data
        self._pxx = [[0.0] * n_features for _ in range(n_features)]
        self._pxy = [0.0] * n_features
        for x, y, w in prior_rows:
            self._accumulate(self._pxx, self._pxy, x, y, w)
        self._coef: tuple[float, ...] | None = None
        #: Observations seen (not decayed).
        self.n_observations = 0
        #: Decayed total weight of the data.
        self.weight = 0.0

    def _accumulate(
        self, xx: list[list[float]], xy: list[float], x: Sequence[float], y: float, w: float
    ) -> None:
        if len(x) != self._n:
            raise ValueError(f"expected {self._n} features, got {len(x)}")
        for i in range(self._n):
            xy[i] += w * x[i] * y
            for j in range(self._n):
                xx[i][j] += w * x[i] * x[j]

    def add(self, x: Sequence[float], y: float) -> None:
        """Adds one observation after decaying the weight of all earlier ones."""
        if not math.isfinite(y):
            raise ValueError(f"observation must be finite, got {y}")
        d = self._decay
        for i in range(self._n):
            self._xy[i] *= d
            for j in range(self._n):
                self._xx[i][j] *= d
        self._accumulate(self._xx, self._xy, x, y, 1.0)
        self.weight = self.weight * d + 1.0
        self.n_observations += 1
        self._coef = None

    @property
    def coef(self) -> tuple[float, ...]:
        """The fitted non-negative coefficients."""
        if self._coef is None:
            self._coef = self._solve()
        return self._coef

    def predict(self, x: Sequence[float]) -> float:
        coef = self.coef
        if len(x) != len(coef):
            raise ValueError(f"expected {len(coef)} features, got {len(x)}")
        return math.fsum(map(operator.mul, coef, x))

    def _solve(self) -> tuple[float, ...]:
        n = self._n
        a = [[self._xx[i][j] + self._pxx[i][j] for j in range(n)] for i in range(n)]
        b = [self._xy[i] + self._pxy[i] for i in range(n)]
        free = list(range(n))
        while free:
            sol = _solve_linear([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            if sol is None:
                # Singular on the free set: drop the coefficient with the least support.
                free.remove(min(free, key=lambda i: a[i][i]))
                continue
            negative = [free[k] for k, v in enumerate(sol) if v < 0.0]
            if not negative:
                coef = [0.0] * n
                for k, i in enumerate(free):
                    coef[i] = sol[k]
                return tuple(coef)
            # Fix the most negative at zero and re-solve the rest.
            worst = min(range(len(sol)), key=lambda k: sol[k])
            free.pop(worst)
        return (0.0,) * n


def _size_class(batch_size: int) -> int:
    """Batch sizes grouped by powers of two: 1 -> 0, 2-3 -> 1, 4-7 -> 2, ..."""
    return batch_size.bit_length() - 1


def _verify_features(batch_size: int, positions: int) -> tuple[float, float, float, float]:
    """``(1, b, P, [P > 1])``: the regressors of ``V(b, P)``."""
    return (1.0, float(batch_size), float(positions), 1.0 if positions > 1 else 0.0)


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solves ``a x = b`` (``a`` symmetric positive semi-definite, a handful of unknowns) by Gaussian
    elimination with partial pivoting.

    Returns None when ``a`` is (numerically) singular: a pivot below ``1e-12`` of the largest diagonal entry.
    """
    n = len(b)
    scale = max(a[i][i] for i in range(n)) if n else 0.0  # bounds every |a_ij| of a PSD matrix
    if scale <= 0.0:
        return None
    m = [[float(v) for v in row] + [float(rhs)] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - math.fsum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(frozen=True)
class CostPrior:
    """What the cost model assumes before (and, for what data cannot tell, besides) its observations.

    Attributes:
        verify_step_ns: anchor: one session, one position (a target decode step), before any data.
        draft_token_ns: anchor: one draft token, before any data.
        per_item_ratio: ``v_b / v0``: one more session in a batch costs this fraction of the fixed cost.
        per_position_ratio: ``v_p / (v0 + v_b)``: one more position costs this fraction of a one-token step.
        prefill_ratio: ``p / d``: a catch-up (prefill) token of the draft costs this fraction of a drafted one.
        expansion_ratio: ``e / d``: a pass that expands a draft tree below its alternatives costs this many
            drafted tokens (it feeds the chain's slots above its nodes again, and the nodes, as a tree).
        ratio_weight: weight of each ratio row, in observations' worth (a data row weighs 1).
        anchor_weight: weight of the absolute anchors; tiny, so one observation overrides them.
        verify_curve: the target's own measurement, at start-up, of one session's verify pass feeding
            ``k = 1, 2, ...`` positions (ns, index ``k - 1``); its shape replaces ``per_position_ratio``.
            Empty: not measured.
        curve_weight: weight of each of the curve's ratio rows.
    """

    verify_step_ns: float = 10e6
    draft_token_ns: float = 1e6
    per_item_ratio: float = 0.08
    per_position_ratio: float = 0.05
    prefill_ratio: float = 0.3
    expansion_ratio: float = 2.0
    ratio_weight: float = 0.5
    anchor_weight: float = 1e-6
    verify_curve: tuple[float, ...] = ()
    curve_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.verify_step_ns <= 0 or self.draft_token_ns < 0:
            raise ValueError("verify_step_ns must be > 0 and draft_token_ns >= 0")
        if min(self.per_item_ratio, self.per_position_ratio, self.prefill_ratio, self.expansion_ratio) < 0:
            raise ValueError("prior ratios must be >= 0")
        if self.ratio_weight < 0 or self.anchor_weight <= 0 or self.curve_weight < 0:
            raise ValueError("ratio_weight and curve_weight must be >= 0 and anchor_weight > 0")
        if any(not (math.isfinite(t) and t > 0) for t in self.verify_curve):
            raise ValueError("verify_curve must hold positive finite times")

    def verify_rows(self) -> list[tuple[tuple[float, float, float, float], float, float]]:
        """Prior rows of the verify fit, ``theta = (v0, v_b, v_p, v_m)`` (docs/design.md, "What the cost
        model learns")."""
        curve = self.verify_curve
        step = curve[0] if curve else self.verify_step_ns
        rows: list[tuple[tuple[float, float, float, float], float, float]] = [
            ((1.0, 1.0, 1.0, 0.0), step, self.anchor_weight),
            ((-self.per_item_ratio, 1.0, 0.0, 0.0), 0.0, self.ratio_weight),
        ]
        if len(curve) < 2:
            r = self.per_position_ratio
            rows += [((-r, -r, 1.0, 0.0), 0.0, self.ratio_weight), ((0.0, 0.0, 0.0, 1.0), 0.0, self.ratio_weight)]
            return rows
        # v_p = slope * V(1, 1) and v_m = step * V(1, 1), with V(1, 1) = v0 + v_b + v_p: rows that hold exactly
        # (a row of the raw curve would not, and would pull the whole fit towards 0 before data).
        slope, step = curve_shape(curve)
        rows += [
            ((-slope, -slope, 1.0 - slope, 0.0), 0.0, self.curve_weight),
            ((-step, -step, -step, 1.0), 0.0, self.curve_weight),
        ]
        return rows


def curve_shape(curve: Sequence[float]) -> tuple[float, float]:
    """``(slope, step)``, both >= 0: the least-squares fit of ``curve[k - 1] / curve[0] = 1 + step + slope * (k - 1)``
    over ``k >= 2`` (one position more costs ``slope`` of a step; going past one position costs ``step``)."""
    if len(curve) < 2:
        return 0.0, 0.0
    xs = [float(k - 1) for k in range(2, len(curve) + 1)]
    ys = [t / curve[0] - 1.0 for t in curve[1:]]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if n > 1 else 0.0
    step = my - slope * mx
    if slope < 0.0:  # a flat or falling tail: a step alone
        slope, step = 0.0, my
    if step < 0.0:  # no step: a line through the first point
        slope, step = max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)), 0.0
    return slope, max(step, 0.0)


class CostModel:
    """Online, decaying estimates of draft, verify and round-trip time (docs/design.md, "What the cost model
    learns").

    Args:
        decay: weight kept by the past at each new observation of a kind
            (0.98: the last ~50 calls count, half-life ~34 calls).
        prior: assumptions before and besides the data.

    The coordinator reports, after each call:

    * ``observe_draft(tokens=proposal depth, ns=ProposeResponse.draft_ns, prefill_tokens=ProposeResponse.prefill_tokens,
      expansion_passes=ProposeResponse.expansion_passes)``: a tree's expansion passes are priced apart from the
      chain's tokens, so a tree round's dearer call does not make every chain look dearer.
    * ``observe_verify(batch_size=len(items), positions=VerifyResponse.positions_processed, ns=VerifyResponse.verify_ns)``
    * ``observe_rtt(ns=call wall time - server-reported time, tokens=draft distributions in the message)``
      for both Propose and Verify calls (for a Verify batch, ``tokens`` per item on average).
    * ``observe_queue(drafted=the proposal came from a Propose call, batch_size=items in the call,
      ns=CallCost.queue_ns)`` for every round's Verify item.
    * ``observe_call_overhead(ns=VerifyResponse.verify_ns, forward_ns=VerifyResponse.forward_ns)``: the
      part of a Verify call spent outside the target's passes (reading the session, deciding, committing),
      which a call of several target steps pays once.
    """

    def __init__(self, *, decay: float = 0.98, prior: CostPrior | None = None) -> None:
        self.prior = prior or CostPrior()
        pr = self.prior
        # theta = (d, p, e): a drafted token, a catch-up token, a tree's expansion pass.
        self._draft = DecayingLeastSquares(
            3,
            decay=decay,
            prior_rows=[
                ((1.0, 0.0, 0.0), pr.draft_token_ns, pr.anchor_weight),
                ((-pr.prefill_ratio, 1.0, 0.0), 0.0, pr.ratio_weight),
                ((-pr.expansion_ratio, 0.0, 1.0), 0.0, pr.ratio_weight),
            ],
        )
        # theta = (v0, v_b, v_p, v_m); the anchor is a one-item, one-position call.
        self._verify = DecayingLeastSquares(4, decay=decay, prior_rows=pr.verify_rows())
        # theta = (r0, r1): round trip of a call carrying k draft distributions; r1 defaults to 0.
        self._rtt = DecayingLeastSquares(2, decay=decay, prior_rows=[((0.0, 1.0), 0.0, pr.ratio_weight)])
        # (drafted, batch-size class) -> decayed mean wait of a round in the Verify batcher, ns.
        self._queue: dict[tuple[bool, int], float] = {}
        # Decayed mean of a Verify call's time outside its forward passes, ns (None before any call).
        self._call_overhead: float | None = None
        self._decay = decay

    # -- observations -------------------------------------------------------------------------

    def observe_draft(self, *, tokens: int, ns: int, prefill_tokens: int = 0, expansion_passes: int = 0) -> None:
        """One Propose call that drafted ``tokens`` deep (after feeding ``prefill_tokens`` to catch up, and with
        ``expansion_passes`` passes that grew a tree below its alternatives) in ``ns``."""
        if tokens < 0 or prefill_tokens < 0 or expansion_passes < 0 or ns < 0:
            raise ValueError("tokens, prefill_tokens, expansion_passes and ns must be >= 0")
        if tokens == 0 and prefill_tokens == 0:
            return
        self._draft.add((float(tokens), float(prefill_tokens), float(expansion_passes)), float(ns))

    def observe_verify(self, *, batch_size: int, positions: int, ns: int) -> None:
        """One Verify call: ``batch_size`` items, ``positions`` fed in total, ``ns`` server time."""
        if batch_size < 1 or positions < batch_size or ns < 0:
            raise ValueError("need batch_size >= 1, positions >= batch_size, ns >= 0")
        self._verify.add(_verify_features(batch_size, positions), float(ns))

    def observe_rtt(self, *, ns: int, tokens: int = 0) -> None:
        """Round trip of one call beyond the server's own time; ``tokens`` draft distributions it carried."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        self._rtt.add((1.0, float(tokens)), float(max(ns, 0)))

    def observe_queue(self, *, drafted: bool, batch_size: int, ns: int) -> None:
        """One round's wait in the Verify batcher (``CallCost.queue_ns``), in a call of ``batch_size``
        items; ``drafted``: the round's proposal came from a Propose call."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        key = (drafted, _size_class(batch_size))
        self._queue[key] = self._decayed(self._queue.get(key), float(max(ns, 0)))

    def observe_call_overhead(self, *, ns: int, forward_ns: int) -> None:
        """One Verify call that took ``ns`` server time, ``forward_ns`` of it in the target's passes."""
        if ns < 0 or forward_ns < 0:
            raise ValueError("ns and forward_ns must be >= 0")
        self._call_overhead = self._decayed(self._call_overhead, float(max(ns - forward_ns, 0)))

    def _decayed(self, old: float | None, new: float) -> float:
        """A decaying mean after one more observation ``new`` (``old`` None: the first)."""
        return new if old is None else self._decay * old + (1.0 - self._decay) * new

    # -- estimates ----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once at least one draft and one verify call have been observed."""
        return self._draft.n_observations > 0 and self._verify.n_observations > 0

    def ready_for(self, *, drafted: bool = True) -> bool:
        """Whether a round's cost rests on data: :attr:`ready`, or for a round that makes no Propose call
        (``drafted=False``: a proposer in the coordinator) once a verify call has been observed."""
        return self.ready if drafted else self._verify.n_observations > 0

    def draft_ns_per_token(self) -> float:
        return self._draft.coef[0]

    def draft_ns(self, tokens: int, prefill_tokens: int = 0, expansion_passes: int = 0) -> float:
        """Predicted server time of a Propose call."""
        return self._draft.predict((float(tokens), float(prefill_tokens), float(expansion_passes)))

    def expansion_pass_ns(self) -> float:
        """What one pass that expands a draft tree below its alternatives adds to a Propose call."""
        return self._draft.coef[2]

    def verify_ns(self, batch_size: int, positions: int) -> float:
        """Predicted server time of a Verify call of ``batch_size`` items feeding ``positions`` in total."""
        return self._verify.predict(_verify_features(batch_size, positions))

    def verify_ns_per_position(self) -> float:
        """Marginal cost of one more position in a Verify call (``v_p``)."""
        return self._verify.coef[2]

    def position_ns(self, batch_size: int, positions: int) -> float:
        """What one more position costs a Verify call of ``batch_size`` items feeding ``positions``, erring high:
        the fit's marginal, or the largest rise of the target's measured curve (``CostPrior.verify_curve``, one
        session) from the positions per session on, in the fit's units there, where that is more. A line with a
        step through a curve with a jump spreads the jump over every position and understates it where it is."""
        fitted = self.verify_ns(batch_size, positions + 1) - self.verify_ns(batch_size, positions)
        curve = self.prior.verify_curve
        k = -(-positions // batch_size)  # positions per session, rounded up
        rises = [after - before for before, after in zip(curve[k - 1 :], curve[k:], strict=False)]
        if not rises:
            return fitted
        return max(fitted, max(rises) * self.verify_ns(1, k) / curve[k - 1])  # scaled where the fit stands now

    def rtt_ns(self, tokens: int = 0) -> float:
        """Predicted round trip of one call carrying ``tokens`` draft distributions (0 before any data)."""
        if self._rtt.n_observations == 0:
            return 0.0
        return self._rtt.predict((1.0, float(tokens)))

    def queue_ns(self, batch_size: int, *, drafted: bool) -> float:
        """Expected wait of a round in the Verify batcher at ``batch_size``: the mean observed for
        rounds of the kind in that batch-size class (1, 2-3, 4-7, ...); 0 before any observation.

        A drafted round is assumed to wait at least as long as an undrafted one: going to the draft
        first never shortens the wait. The two means are learnt from different rounds, often at
        different times (drafted ones mostly from probes); in a burst, undrafted rounds queued behind
        prefills can wait far longer than the last drafted ones did, and the bare means then make
        drafting look cheaper than not drafting (docs/benchmarks/history.md)."""
        cls = _size_class(batch_size)
        undrafted = self._queue.get((False, cls), 0.0)
        if not drafted:
            return undrafted
        return max(self._queue.get((True, cls), 0.0), undrafted)

    def round_ns(self, gamma: int, batch_size: int, *, drafted: bool = True) -> float:
        """Predicted wall time of one round of one session; docs/design.md, "What the cost model learns".

        ``drafted=False``: the proposal costs no Propose call (a proposer in the coordinator).
        """
        if gamma < 0 or batch_size < 1:
            raise ValueError("need gamma >= 0 and batch_size >= 1")
        d = self._draft.coef[0]
        r0, r1 = self._rtt.coef if self._rtt.n_observations else (0.0, 0.0)
        rtt = r0 + r1 * gamma
        total = rtt + self.verify_ns(batch_size, batch_size * (gamma + 1))
        if gamma > 0 and drafted:
            total += rtt + d * gamma
        return total + self.queue_ns(batch_size, drafted=gamma > 0 and drafted)

    def target_only_token_ns(self, batch_size: int = 1, steps_per_call: int = 1) -> float:
        """Predicted wall time per token of target-only rounds whose Verify call takes ``steps_per_call``
        target steps (``VerifyItem.decode_steps``): the call's fixed part once per call, the rest of
        ``round(0)`` once per step.

        The fixed part is what a call pays outside its passes: the round trip, the batcher's wait and the
        Verify's time outside the target's forward passes (:meth:`verify_call_overhead_ns`). The verify
        fit's intercept ``v0`` is not in it: a one-position pass is mostly a fixed cost (the weights are
        read whatever the positions), and every step pays that pass again.
        """
        if steps_per_call < 1:
            raise ValueError("steps_per_call must be >= 1")
        one = self.round_ns(0, batch_size)
        verify = self.verify_ns(batch_size, batch_size)
        fixed = (one - verify) + min(self.verify_call_overhead_ns(), verify)
        return fixed / steps_per_call + (one - fixed)

    def verify_call_overhead_ns(self) -> float:
        """A Verify call's time outside the target's passes, decayed mean (0 before any call)."""
        return self._call_overhead or 0.0

    def target_step_ns(self, batch_size: int = 1) -> float:
        """Predicted wall time of a target-only round (``round_ns(0, batch_size)``)."""
        return self.round_ns(0, batch_size)

    def predicted_speedup(self, alpha: float, gamma: int, batch_size: int = 1) -> float:
        """The bound with the learnt costs, round trips included: ``E(alpha, gamma) * round(0) / round(gamma)``.

        ``round`` is :meth:`round_ns` at ``batch_size``; with no round trip and one session this is
        :func:`predicted_speedup` with ``T_draft = draft_ns_per_token()``, ``T_verify = verify_ns(1, .)``
        and ``T_target = verify_ns(1, 1)``.
        """
        return (
            expected_tokens_iid(alpha, gamma)
            * self.round_ns(0, batch_size)
            / self.round_ns(gamma, batch_size)
        )

    def snapshot(self) -> dict[str, float]:
        """Current estimates, for logs, metrics and the benchmark report."""
        v0, vb, vp, vm = self._verify.coef
        r0, r1 = self._rtt.coef if self._rtt.n_observations else (0.0, 0.0)
        return {
            "draft_ns_per_token": self.draft_ns_per_token(),
            "draft_prefill_ns_per_token": self._draft.coef[1],
            "draft_expansion_pass_ns": self.expansion_pass_ns(),
            "verify_fixed_ns": v0,
            "verify_ns_per_item": vb,
            "verify_ns_per_position": vp,
            "verify_multi_position_ns": vm,
            "rtt_ns": r0,
            "rtt_ns_per_token": r1,
            "verify_call_overhead_ns": self.verify_call_overhead_ns(),
        }
