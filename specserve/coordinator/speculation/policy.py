"""The speculation policy: how many tokens a session drafts in its next round.

The objective is wall-clock cost per committed token under the real workload
(docs/design.md, "Cost and policy"), not acceptance. Three pieces:

* :class:`~specserve.coordinator.speculation.cost_model.CostModel` (one per coordinator): what a round
  costs, learnt online from call timings;
* :class:`~specserve.coordinator.speculation.acceptance.AcceptanceTracker` (one per session): how
  many tokens a round commits, learnt online from the session's verdicts, per
  draft position;
* :class:`SpeculationPolicy` (one per coordinator, or per request for a fixed
  gamma): :class:`FixedGamma` or :class:`AdaptiveGamma`.

How the coordinator drives them, each round of each session::

    load = pool.load()   # LoadSnapshot(active_sessions=..., batch_occupancy=..., verify_queue_depth=...)
    local = ...          # the next proposal comes from the coordinator (Speculator._local): no draft cost
    gamma = min(policy.choose_gamma(tracker, load, local_draft=local), tokens_left - 1, server_max_gamma)
    pool.propose(...)  # the fleet: cost_model.observe_draft(...), cost_model.observe_rtt(...)
    pool.verify(...)   # the fleet, once per call: cost_model.observe_verify(...), cost_model.observe_rtt(...);
                       # once per item: cost_model.observe_queue(...) (its wait in the batcher, drafted or not)
    tracker.observe(proposed=gamma, accepted=verdict.accepted)   # also when gamma == 0

Terms: a round with ``gamma`` proposals feeds ``gamma + 1`` positions to the
target and commits ``accepted + 1`` tokens (the accepted prefix, then the
correction after a rejection or the bonus token when all are accepted). The
positions fed but not committed, ``gamma - accepted``, are *wasted* target work.

The module is pure Python: no torch, no gRPC, no logging.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.coordinator.speculation.acceptance import AcceptanceTracker
from specserve.coordinator.speculation.cost_model import (
    CostModel,
    CostPrior,
    expected_tokens_iid,
    predicted_speedup,
)

__all__ = [
    "GAMMA_LADDER",
    "AcceptanceTracker",
    "AdaptiveGamma",
    "CostModel",
    "CostPrior",
    "FixedGamma",
    "LoadSnapshot",
    "SpeculationPolicy",
    "expected_tokens_iid",
    "predicted_speedup",
]


#: The one gamma ladder: fine where the optimum usually lies, coarse above, where the goodput curve is flat.
#: 12 and 16 are for proposers whose runs are long when they hit (the n-gram lookup on copied text): on
#: this CPU a pass over 17 positions cost about what one over 9 did, so a copied run commits up to 17 tokens
#: per pass where 8 proposals stop at 9.
GAMMA_LADDER: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class LoadSnapshot:
    """How busy the target tier is, as the coordinator sees it when a round starts.

    Attributes:
        active_sessions: sessions generating now.
        batch_occupancy: recent mean Verify batch size / ``max_batch_size``, in [0, 1].
        verify_queue_depth: sessions waiting for a Verify batch.
    """

    active_sessions: int
    batch_occupancy: float
    verify_queue_depth: int

    def __post_init__(self) -> None:
        if self.active_sessions < 0 or self.verify_queue_depth < 0:
            raise ValueError("active_sessions and verify_queue_depth must be >= 0")
        if not 0.0 <= self.batch_occupancy <= 1.0:
            raise ValueError(f"batch_occupancy must be in [0, 1], got {self.batch_occupancy}")

    @classmethod
    def idle(cls) -> LoadSnapshot:
        """One session alone: no batching, no queue."""
        return cls(active_sessions=1, batch_occupancy=0.0, verify_queue_depth=0)


class SpeculationPolicy(abc.ABC):
    """Chooses a session's gamma for its next round."""

    @abc.abstractmethod
    def choose_gamma(
        self,
        acceptance: AcceptanceTracker,
        load: LoadSnapshot,
        *,
        local_draft: bool = False,
        zero_steps: int | None = None,
    ) -> int:
        """The number of tokens to draft next round (0: a plain target decode step).

        ``local_draft``: the proposal will come from a proposer in the coordinator (prediction,
        n-gram), which costs no draft call. ``zero_steps``: target steps a round at gamma 0 would
        take (None: one for a local draft, which keeps one step per round, else ``decode_steps``).
        """


class FixedGamma(SpeculationPolicy):
    """Always the same gamma (a request's explicit ``gamma``, or a benchmark baseline)."""

    def __init__(self, gamma: int) -> None:
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = gamma

    def choose_gamma(
        self,
        acceptance: AcceptanceTracker,
        load: LoadSnapshot,
        *,
        local_draft: bool = False,
        zero_steps: int | None = None,
    ) -> int:
        acceptance.last_gamma = self.gamma
        return self.gamma

    def __repr__(self) -> str:
        return f"FixedGamma({self.gamma})"


class AdaptiveGamma(SpeculationPolicy):
    """Picks gamma from a small ladder (0 included) by expected committed tokens per unit of cost.

    The score of ``g`` proposals for a session with acceptance estimates ``a_i``
    in a batch of ``b`` sessions is::

        E(g)     = 1 + sum_{k=1..g} prod_{i=1..k} a_i             expected committed tokens
        W(g)     = g + 1 - E(g)                                   expected wasted target positions
        cost(g)  = round_ns(g, b) + lambda(load) * W(g) * v_p     ns   (no draft cost for a local draft)
        score(g) = E(g) / cost(g)                                 committed tokens per ns

    ``round_ns`` is the session's own latency (:meth:`CostModel.round_ns`: draft,
    both round trips, a Verify of ``b`` sessions feeding ``g + 1`` positions
    each, and the wait in the batcher learnt for drafted and undrafted
    rounds) and ``v_p`` the marginal verify cost of a position. The second term
    is the load awareness: a wasted position in a full batch delays every other
    session riding in that batch or queued behind it, so it is charged once per
    such session, scaled by how saturated the target is::

        pressure(load) = max(clip((occupancy - occupancy_knee) / (1 - occupancy_knee), 0, 1),
                             min(1, queue_depth / max_batch_size))
        lambda(load)   = waste_weight * pressure * (b - 1 + queue_depth)
        b              = clip(round(occupancy * max_batch_size), 1, max(1, active_sessions))

    With spare parallelism (``v_p`` near 0, or a half-empty batch) the score is
    plain goodput and speculation is nearly free; as batches fill, ``b`` grows
    (so ``round_ns`` carries more positions) and the waste charge rises, so
    gamma shrinks, down to 0 where no speculation pays for its rejected work.
    Waste is charged rather than all target work because accepted positions
    replace target steps the session would have run anyway.

    Safeguards:

    * **Hysteresis**: the choice moves from the last gamma only when the best
      allowed score beats the last one's by more than ``switch_margin``.
    * **Bounds**: gamma grows by at most one rung of the ladder per round (a few
      easy tokens cannot trigger a long draft just before the text changes); it
      may fall to any lower rung at once. A proposer in the coordinator
      (``local_draft``) may go to any rung: it offers tokens only where its
      lookup matches, and a longer proposal costs it no draft time (on copied
      code climbing one rung per round was slower than going straight up:
      docs/benchmarks/history.md, "Figures moved out of the code").
    * **Cold start**: a session's first round uses the best rung not above
      ``initial_gamma`` (just ``initial_gamma`` while the cost model has no data),
      then climbs one rung per round at most. A session whose tracker starts
      from other sessions' acceptance (``warm_start``: the coordinator's
      :class:`~specserve.coordinator.speculation.acceptance.AcceptanceMemory` for its proposer and
      sampling) starts at the best rung of the whole ladder for that estimate.
    * **Probing out of 0**: a session at gamma = 0 learns nothing about
      acceptance (its tracker neither learns nor forgets on such rounds), so after
      ``probe_interval`` rounds at 0 it runs one round at the lowest non-zero rung.
      When the probe's token is rejected the interval doubles (up to
      ``max_probe_interval``), so probing a hopeless pair costs ever less; when
      it is accepted but not enough to stay, the interval halves (down to
      ``probe_interval``); leaving 0 on the evidence resets it. The interval
      counts target passes, not session rounds: in a batch of ``b`` sessions
      (:meth:`batch_size`) a probe needs ``b`` times as many rounds at 0, since
      ``b`` rounds at 0 make one pass and a probe widens the whole padded pass
      (every row gets a second column), so under load probing costs no larger
      a share of the target's time than it does for one session alone. Sessions
      warm-started under one key share this clock
      (:class:`~specserve.coordinator.speculation.acceptance.ProbeClock`): the rounds at 0 of all of
      them count towards one probe, whose outcome feeds the pooled acceptance
      they all start from. (Sessions of a proposer in the coordinator, whose
      acceptance belongs to the text rather than the pair, start cold and
      probe on their own.)

    Tuning constants (defaults, and why):

    * ``choices=GAMMA_LADDER`` (0, 1, 2, 3, 4, 6, 8, 12, 16): fine where the optimum usually
      lies, coarse above, where the goodput curve is flat; :meth:`up_to` cuts it
      at a server's largest gamma.
    * ``switch_margin=0.03``: near the optimum the goodput curve is flat (on the
      test grid, neighbouring rungs often differ by 1-3%), so a wider band parks
      the choice two rungs away at a small loss; a narrower one lets estimate
      noise flap between neighbours. 3% measured best on the simulated grid in
      the tests (mean efficiency against the brute-force optimum ~99%).
    * ``initial_gamma=2``: modest; about the optimum for alpha ~0.6 at draft cost
      ~0.1 of a target step.
    * ``occupancy_knee=0.5``: below half-full batches there is room for more
      positions at little cost; above it the waste charge rises linearly to full.
    * ``waste_weight=1.0``: each other session delayed counts as much as the
      session itself (utilitarian: total latency of all sessions).
    * ``probe_interval=8``, ``max_probe_interval=64``: a hopeless pair costs one
      probe round in 64 at worst (for a draft as slow as the target, about 1.5%
      of throughput); a pair that got unlucky once is re-tested within 8 rounds.

    Args:
        cost_model: the coordinator's shared cost model.
        choices: the ladder of gammas; must include 0.
        max_batch_size: the coordinator's most sessions per Verify call.
    """

    def __init__(
        self,
        cost_model: CostModel,
        choices: Sequence[int] = GAMMA_LADDER,
        *,
        max_batch_size: int = 16,
        initial_gamma: int = 2,
        switch_margin: float = 0.03,
        occupancy_knee: float = 0.5,
        waste_weight: float = 1.0,
        probe_interval: int | None = 8,
        max_probe_interval: int = 64,
        decode_steps: int = 1,
    ) -> None:
        ladder = tuple(sorted(set(choices)))
        if not ladder or ladder[0] != 0 or any(g < 0 for g in ladder):
            raise ValueError(f"choices must be non-negative and include 0, got {tuple(choices)}")
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if initial_gamma < 0:
            raise ValueError("initial_gamma must be >= 0")
        if switch_margin < 0:
            raise ValueError("switch_margin must be >= 0")
        if not 0.0 <= occupancy_knee < 1.0:
            raise ValueError("occupancy_knee must be in [0, 1)")
        if waste_weight < 0:
            raise ValueError("waste_weight must be >= 0")
        if probe_interval is not None and not 1 <= probe_interval <= max_probe_interval:
            raise ValueError("probe_interval must be None or in [1, max_probe_interval]")
        if decode_steps < 1:
            raise ValueError("decode_steps must be >= 1")
        self.cost_model = cost_model
        self.choices = ladder
        self.max_batch_size = max_batch_size
        self.initial_gamma = initial_gamma
        self.switch_margin = switch_margin
        self.occupancy_knee = occupancy_knee
        self.waste_weight = waste_weight
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        #: Target steps per Verify call of a round at gamma 0 (the coordinator's ``decode_steps``).
        self.decode_steps = decode_steps

    @classmethod
    def up_to(cls, cost_model: CostModel, max_gamma: int, **kwargs: object) -> AdaptiveGamma:
        """The policy on :data:`GAMMA_LADDER` cut at ``max_gamma`` (other arguments as the constructor)."""
        return cls(cost_model, tuple(g for g in GAMMA_LADDER if g <= max_gamma), **kwargs)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"AdaptiveGamma(choices={self.choices}, margin={self.switch_margin})"

    # -- the objective ------------------------------------------------------------------------

    def batch_size(self, load: LoadSnapshot) -> int:
        """The batch size a round is expected to ride in."""
        b = round(load.batch_occupancy * self.max_batch_size)
        return max(1, min(b, self.max_batch_size, max(1, load.active_sessions)))

    def pressure(self, load: LoadSnapshot) -> float:
        """How saturated the target is, 0 (spare room) .. 1 (full batches or a queue)."""
        occ = (load.batch_occupancy - self.occupancy_knee) / (1.0 - self.occupancy_knee)
        queue = load.verify_queue_depth / self.max_batch_size
        return max(min(max(occ, 0.0), 1.0), min(queue, 1.0))

    def waste_charge(self, load: LoadSnapshot) -> float:
        """``lambda(load)``: sessions delayed by one wasted position, weighted by pressure."""
        others = self.batch_size(load) - 1 + load.verify_queue_depth
        return self.waste_weight * self.pressure(load) * others

    def scores(
        self,
        acceptance: AcceptanceTracker,
        load: LoadSnapshot,
        *,
        local_draft: bool = False,
        zero_steps: int | None = None,
    ) -> dict[int, float]:
        """``score(g)`` (expected committed tokens per ns) for every rung of the ladder (``local_draft``,
        ``zero_steps``: as :meth:`SpeculationPolicy.choose_gamma`)."""
        if zero_steps is None:  # a session drafting locally keeps one step per round (Speculator._steps)
            zero_steps = 1 if local_draft else self.decode_steps
        cm = self.cost_model
        b = self.batch_size(load)
        charge = self.waste_charge(load) * cm.verify_ns_per_position()
        out: dict[int, float] = {}
        for g in self.choices:
            expected = acceptance.expected_tokens(g)
            if g == 0:  # one token per step; the call's fixed part is shared by the call's steps
                cost = cm.target_only_token_ns(b, zero_steps)
            else:
                cost = cm.round_ns(g, b, drafted=not local_draft) + charge * (g + 1 - expected)
            out[g] = expected / max(cost, 1.0)
        return out

    # -- the choice ---------------------------------------------------------------------------

    def _rung(self, gamma: int) -> int:
        """Index of the highest rung not above ``gamma``."""
        idx = 0
        for i, g in enumerate(self.choices):
            if g <= gamma:
                idx = i
        return idx

    def choose_gamma(
        self,
        acceptance: AcceptanceTracker,
        load: LoadSnapshot,
        *,
        local_draft: bool = False,
        zero_steps: int | None = None,
    ) -> int:
        last = acceptance.last_gamma
        ready = self.cost_model.ready_for(drafted=not local_draft)
        if last is None:  # the first round: cautious, unless other sessions' rounds back the prior
            top = len(self.choices) - 1 if acceptance.warm_start and ready else self._rung(self.initial_gamma)
            if ready:
                scores = self.scores(acceptance, load, local_draft=local_draft, zero_steps=zero_steps)
                choice = max(self.choices[: top + 1], key=lambda g: scores[g])
            else:
                choice = self.choices[top]
            return self._record(acceptance, choice)
        current = self.choices[self._rung(last)]
        if not ready:
            return self._record(acceptance, current)
        scores = self.scores(acceptance, load, local_draft=local_draft, zero_steps=zero_steps)
        # Up one rung at most, down any (a proposer in the coordinator: any; see Bounds above).
        allowed = self.choices if local_draft else self.choices[: self._rung(current) + 2]
        best = max(allowed, key=lambda g: scores[g])  # ties: the smaller gamma
        if best != current and scores[best] <= scores[current] * (1.0 + self.switch_margin):
            best = current
        if acceptance.probing:
            acceptance.probing = False
            if acceptance.last_accepted == 0:
                acceptance.probe_interval = min(2 * self._interval(acceptance), self.max_probe_interval)
            else:  # promising, if not yet enough: come back sooner
                acceptance.probe_interval = max(self._interval(acceptance) // 2, self.probe_interval or 1)
        if best == 0 and self.probe_interval is not None and len(self.choices) > 1:
            if acceptance.rounds_at_zero >= self._interval(acceptance) * self.batch_size(load):
                acceptance.probing = True
                best = self.choices[1]
        elif best > 0 and not acceptance.probing:
            acceptance.probe_interval = None
        return self._record(acceptance, best)

    def _interval(self, acceptance: AcceptanceTracker) -> int:
        base = self.probe_interval if self.probe_interval is not None else 0
        return acceptance.probe_interval if acceptance.probe_interval is not None else base

    @staticmethod
    def _record(acceptance: AcceptanceTracker, gamma: int) -> int:
        acceptance.rounds_at_zero = acceptance.rounds_at_zero + 1 if gamma == 0 else 0
        acceptance.last_gamma = gamma
        return gamma
