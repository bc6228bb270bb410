"""One session's acceptance of draft tokens, per draft position, learnt online.

Terms: a round with ``gamma`` proposals *reaches* draft position ``i`` (1-based)
when the ``i - 1`` tokens before it were accepted; the verifier accepts or
rejects each reached position in order and stops at the first rejection. The
tracker estimates ``a_i = P(accept position i | reached it)`` and from it the
expected committed tokens of a round, ``1 + sum_{k=1..gamma} prod_{i<=k} a_i``
(the accepted prefix plus the correction or bonus token; under i.i.d.
acceptance ``alpha`` this is ``(1 - alpha**(gamma+1)) / (1 - alpha)``).

Pure Python: no torch, no gRPC, no logging.
"""

from __future__ import annotations

import math

__all__ = ["AcceptanceMemory", "AcceptanceTracker", "ProbeClock"]


class _DecayedCounts:
    """Per-position counts of reached and accepted draft positions, decayed per round."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.reached: list[float] = []  # [i]: decayed rounds that reached position i + 1
        self.accepted: list[float] = []  # [i]: decayed rounds that accepted position i + 1
        self.reached_total = 0.0
        self.accepted_total = 0.0

    def add(self, reached: int, accepted: int) -> None:
        d = self.decay
        self.reached = [v * d for v in self.reached]
        self.accepted = [v * d for v in self.accepted]
        self.reached_total = self.reached_total * d + reached
        self.accepted_total = self.accepted_total * d + accepted
        while len(self.reached) < reached:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for i in range(reached):
            self.reached[i] += 1.0
        for i in range(accepted):
            self.accepted[i] += 1.0

    def copy_from(self, other: _DecayedCounts) -> None:
        self.reached = list(other.reached)
        self.accepted = list(other.accepted)
        self.reached_total = other.reached_total
        self.accepted_total = other.accepted_total

    def scale_to(self, reached_total: float) -> None:
        """Scales every count down so that at most ``reached_total`` reached positions remain."""
        if self.reached_total > reached_total > 0.0:
            f = reached_total / self.reached_total
            self.reached = [v * f for v in self.reached]
            self.accepted = [v * f for v in self.accepted]
            self.reached_total *= f
            self.accepted_total *= f

    def clear(self) -> None:
        self.reached, self.accepted = [], []
        self.reached_total = self.accepted_total = 0.0


class ProbeClock:
    """The policy's probing out of gamma = 0: rounds at 0 since the last probe, and the interval before the next.

    Each session has its own, unless it was warm-started from an :class:`AcceptanceMemory`: then it shares
    its key's, so that sessions which all learn from the same pooled acceptance also share the probing that
    feeds it: one probe per interval across them (backing off after fruitless probes), not one per session.
    On a pair whose draft does not pay, per-session probing cost a short request several probe rounds and the
    draft's catch-up on its prompt, each time.
    """

    __slots__ = ("fruitless", "probe_interval", "rounds_at_zero")

    def __init__(self) -> None:
        #: Rounds in a row at gamma = 0 (of every session sharing the clock).
        self.rounds_at_zero = 0
        #: Rounds at gamma = 0 before the next probe; None: the policy's base interval.
        self.probe_interval: int | None = None
        #: Probes in a row whose token was rejected (the interval backs off at the second).
        self.fruitless = 0


class AcceptanceTracker:
    """One session's recent acceptance per draft position, exponentially decaying.

    Per position ``i``, ``a_i = P(accept i | reached i)`` from decayed counts shrunk towards the pooled
    estimate and a prior; two CUSUM detectors rebuild the estimates after a fall or a rise of acceptance. It
    also holds the policy's memory of the session (:attr:`last_gamma`, the probing state). The estimator and
    why: docs/design.md, "Acceptance per position".

    Args:
        decay: weight the slow memory keeps at each speculative round (0.97:
            half-life ~23 rounds, ~70 tokens at 3 per round). A round with
            ``proposed == 0`` teaches nothing and forgets nothing.
        fall_threshold: CUSUM alarm level of the fall detector, in nats (8.0: a fall
            from 0.95 to 0.05 is believed within 3-6 rounds; on stationary sequences
            false alarms are ~1 per 1,000 rounds; 5.0 halved the delay but tripled the
            false alarms, each of which costs a dip of gamma for a few rounds).
        rise_threshold: the same for the rise detector (6.0: a false rise only lets
            gamma climb, one rung per round, so it may be a little quicker).
        reset_weight: after an alarm, the rounds since the change are kept with at
            most this many reached positions' weight (4.0), so the next few rounds
            move the estimate quickly, whether the alarm was true or false.
        prior_alpha: acceptance assumed before data.
        prior_weight: the prior's weight, in reached positions.
        position_shrinkage: weight, in reached positions, of the pooled estimate in each
            per-position estimate.
    """

    def __init__(
        self,
        *,
        decay: float = 0.97,
        fall_threshold: float = 8.0,
        rise_threshold: float = 6.0,
        reset_weight: float = 4.0,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
        position_shrinkage: float = 4.0,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {prior_alpha}")
        if prior_weight <= 0 or position_shrinkage < 0:
            raise ValueError("prior_weight must be > 0 and position_shrinkage >= 0")
        if fall_threshold <= 0 or rise_threshold <= 0 or reset_weight <= 0:
            raise ValueError("fall_threshold, rise_threshold and reset_weight must be > 0")
        self._slow = _DecayedCounts(decay)
        self._threshold = {"fall": fall_threshold, "rise": rise_threshold}  # CUSUM alarm levels, nats
        self._cusum = {"fall": 0.0, "rise": 0.0}  # detector sums, nats
        self._segment = {
            "fall": _DecayedCounts(decay),
            "rise": _DecayedCounts(decay),
        }  # rounds since each was 0
        self._curve: list[float] | None = None  # expected_tokens(g) for g = 0.., cached until the next change
        self._reset_weight = reset_weight
        self._prior_alpha = prior_alpha
        self._prior_weight = prior_weight
        self._shrinkage = position_shrinkage
        #: Rounds observed.
        self.rounds = 0
        #: Changes of regime detected (the estimates were rebuilt from the rounds since the change).
        self.changes = 0
        #: Accepted tokens of the last speculative round observed (None before one).
        self.last_accepted: int | None = None
        #: The gamma the policy chose last for this session (None before the first round).
        self.last_gamma: int | None = None
        #: The policy's probing state (policy memory; shared with other sessions when warm-started).
        self.probe_clock = ProbeClock()
        #: True while the round just chosen is a probe out of gamma = 0 (policy memory).
        self.probing = False
        #: True when the policy may start at the best gamma for the prior rather than at its cautious
        #: initial one: the prior came from other sessions' rounds (:class:`AcceptanceMemory`), or the
        #: session's proposals cost no draft call (a proposer in the coordinator).
        self.warm_start = False

    @property
    def rounds_at_zero(self) -> int:
        """Rounds in a row at gamma = 0 (:attr:`probe_clock`)."""
        return self.probe_clock.rounds_at_zero

    @rounds_at_zero.setter
    def rounds_at_zero(self, value: int) -> None:
        self.probe_clock.rounds_at_zero = value

    @property
    def fruitless_probes(self) -> int:
        """Probes in a row whose token was rejected (:class:`ProbeClock`)."""
        return self.probe_clock.fruitless

    @fruitless_probes.setter
    def fruitless_probes(self, value: int) -> None:
        self.probe_clock.fruitless = value

    @property
    def probe_interval(self) -> int | None:
        """Rounds at gamma = 0 before the next probe; None: the policy's base interval (:attr:`probe_clock`)."""
        return self.probe_clock.probe_interval

    @probe_interval.setter
    def probe_interval(self, value: int | None) -> None:
        self.probe_clock.probe_interval = value

    def observe(self, *, proposed: int, accepted: int) -> None:
        """One round's verdict: ``proposed`` draft tokens, the first ``accepted`` of them accepted."""
        if proposed < 0 or not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted=} {proposed=}")
        self.rounds += 1
        if proposed == 0:
            return  # nothing learnt, and nothing forgotten: a parked session keeps its evidence
        reached = min(proposed, accepted + 1)
        self.last_accepted = accepted
        alarm = False
        estimates = [min(max(self.position_alpha(i), 0.02), 0.98) for i in range(1, reached + 1)]
        self._curve = None
        for kind in ("fall", "rise"):
            total = self._cusum[kind]
            for i, a in enumerate(estimates, start=1):
                alt = a / 2.0 if kind == "fall" else (1.0 + a) / 2.0
                total += math.log(alt / a) if i <= accepted else math.log((1.0 - alt) / (1.0 - a))
            segment = self._segment[kind]
            if total <= 0.0:
                total = 0.0
                segment.clear()
            else:
                segment.add(reached, accepted)
            self._cusum[kind] = total
            if total > self._threshold[kind] and not alarm:
                alarm = True
                self._slow.copy_from(segment)
                self._slow.scale_to(self._reset_weight)
        if alarm:
            self.changes += 1
            for kind in ("fall", "rise"):
                self._cusum[kind] = 0.0
                self._segment[kind].clear()
        else:
            self._slow.add(reached, accepted)

    def alpha(self) -> float:
        """Estimated per-token acceptance, pooled over positions."""
        slow = self._slow
        return (slow.accepted_total + self._prior_alpha * self._prior_weight) / (
            slow.reached_total + self._prior_weight
        )

    def position_alpha(self, position: int) -> float:
        """Estimated ``P(accept position | reached it)``, ``position`` 1-based."""
        if position < 1:
            raise ValueError("positions are 1-based")
        pooled = self.alpha()
        slow = self._slow
        if position > len(slow.reached):
            return pooled
        i = position - 1
        return (slow.accepted[i] + self._shrinkage * pooled) / (slow.reached[i] + self._shrinkage)

    def expected_tokens(self, gamma: int) -> float:
        """Expected committed tokens of a round with ``gamma`` proposals: ``1 + sum_k prod_{i<=k} a_i``."""
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        curve = self._curve
        if curve is None or len(curve) <= gamma:
            curve = [1.0]
            survive = 1.0
            for k in range(1, max(gamma, 8) + 1):
                survive *= self.position_alpha(k)
                curve.append(curve[-1] + survive)
            self._curve = curve
        return curve[gamma]


class AcceptanceMemory:
    """Pooled acceptance per kind of speculation, across sessions: where a new session starts from.

    A session's :class:`AcceptanceTracker` learns its own acceptance, but a
    request's first rounds would otherwise start from a fixed prior and climb
    one rung of gamma per round, which throws away most of a short request on
    a pair (or a proposer, such as the n-gram lookup on text that repeats its
    input) whose acceptance the coordinator has already seen many times. This
    keeps, per key (the caller's: proposer, local proposers, greedy or
    sampled), decayed counts of reached and accepted draft positions over every
    round of every session, and offers their ratio as the next session's prior
    once ``min_reached`` positions back it.

    Args:
        decay: weight the counts keep at each round observed under the key
            (0.995: the last few hundred rounds count).
        min_reached: reached positions needed before :meth:`prior` answers.
        max_keys: keys kept (least recently observed dropped first).
    """

    def __init__(self, *, decay: float = 0.995, min_reached: float = 16.0, max_keys: int = 64) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if min_reached <= 0 or max_keys < 1:
            raise ValueError("min_reached must be > 0 and max_keys >= 1")
        self.decay = decay
        self.min_reached = min_reached
        self.max_keys = max_keys
        self._counts: dict[str, tuple[float, float]] = {}  # key -> (reached, accepted), decayed
        self._clocks: dict[str, ProbeClock] = {}  # key -> the probing shared by its warm-started sessions

    def observe(self, key: str, *, proposed: int, accepted: int) -> None:
        """One round of a session under ``key``: ``proposed`` tokens, the first ``accepted`` accepted."""
        if proposed <= 0:
            return
        reached = min(accepted + 1, proposed)
        r, a = self._counts.pop(key, (0.0, 0.0))
        self._counts[key] = (r * self.decay + reached, a * self.decay + accepted)
        while len(self._counts) > self.max_keys:
            del self._counts[next(iter(self._counts))]

    def probe_clock(self, key: str) -> ProbeClock:
        """The probing state shared by the sessions warm-started under ``key`` (:class:`ProbeClock`)."""
        clock = self._clocks.pop(key, None) or ProbeClock()
        self._clocks[key] = clock
        while len(self._clocks) > self.max_keys:
            del self._clocks[next(iter(self._clocks))]
        return clock

    def prior(self, key: str) -> float | None:
        """Pooled per-token acceptance under ``key``, or None while too few positions back it."""
        r, a = self._counts.get(key, (0.0, 0.0))
        return a / r if r >= self.min_reached else None
