"""The speculation policy: how many tokens a session drafts in its next round.

The objective is wall-clock cost per committed token under the real workload, not acceptance. The
:class:`~specserve.coordinator.speculation.cost_model.CostModel` (one per coordinator) says what a round
costs, the session's :class:`~specserve.coordinator.speculation.acceptance.AcceptanceTracker` how many tokens
it commits, and a :class:`SpeculationPolicy` (:class:`FixedGamma`, or the coordinator's
:class:`AdaptiveGamma`) picks gamma from them once per round for the session's speculator (docs/design.md,
"Cost and policy"). The module is pure Python: no torch, no gRPC, no logging.
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

#: A tree's alternative must promise this many times its break-even: the draft's probability of a runner-up
#: stands in for the target's chance of taking it, and the verify fit is a line extrapolated past the positions
#: it was measured at (docs/design.md, "Draft trees from the draft's ranking").
TREE_MARGIN = 2.0
#: The least path probability an alternative needs however cheap a position is: below it a node's expected gain
#: is under 1% of a token, less than the wire and attention work the verify fit does not see.
TREE_FLOOR = 0.01


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
        target_only_steps: int | None = None,
    ) -> int:
        """The number of tokens to draft next round (0: a plain target decode step).

        ``local_draft``: the proposal will come from a proposer in the coordinator (prediction,
        n-gram), which costs no draft call. ``target_only_steps``: target steps a round at gamma 0 would
        take (None: one for a local draft, which keeps one step per round, else ``decode_steps``).
        """

    def tree_min_path_probability(
        self, acceptance: AcceptanceTracker, load: LoadSnapshot, gamma: int
    ) -> float:
        """The path probability a draft tree's alternative needs in a round of ``gamma`` drafted tokens (1: none
        is added, the proposal is a chain). Here: 1, a chain; :class:`AdaptiveGamma` prices the node."""
        return 1.0

    def tree_expand_min_path_probability(
        self, acceptance: AcceptanceTracker, load: LoadSnapshot, gamma: int
    ) -> float:
        """The path probability an alternative needs to be expanded (one more draft pass per level of the tree
        below the alternatives) in a round of ``gamma`` drafted tokens (1: none is). Here: 1;
        :class:`AdaptiveGamma` prices the pass."""
        return 1.0


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
        target_only_steps: int | None = None,
    ) -> int:
        acceptance.last_gamma = self.gamma
        return self.gamma

    def __repr__(self) -> str:
        return f"FixedGamma({self.gamma})"


class AdaptiveGamma(SpeculationPolicy):
    """Picks gamma from a small ladder (0 included) by expected committed tokens per unit of cost.

    ``score(g) = E(g) / (round_ns(g, b) + lambda(load) * W(g) * v_p)``: a round's expected committed tokens
    over its cost, its expected wasted positions charged more as the target's batches fill. Around the score:
    hysteresis (``switch_margin``), at most one rung up per round (a local draft: any), a cautious first round
    unless warm-started, and probes out of gamma 0 on a backing-off clock. The derivation, the safeguards and
    why each default has its value: docs/design.md, "How the adaptive policy scores a gamma".

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
        target_only_steps: int | None = None,
    ) -> dict[int, float]:
        """``score(g)`` (expected committed tokens per ns) for every rung of the ladder (``local_draft``,
        ``target_only_steps``: as :meth:`SpeculationPolicy.choose_gamma`)."""
        if target_only_steps is None:  # a local draft keeps one step per round (Speculator._target_steps)
            target_only_steps = 1 if local_draft else self.decode_steps
        b = self.batch_size(load)
        out: dict[int, float] = {}
        for g in self.choices:
            if g == 0:  # one token per step; the call's fixed part is shared by the call's steps
                out[g] = 1.0 / max(self.cost_model.target_only_token_ns(b, target_only_steps), 1.0)
            else:
                out[g] = self._drafted_score(acceptance, load, g, local_draft=local_draft)
        return out

    def _drafted_score(
        self, acceptance: AcceptanceTracker, load: LoadSnapshot, gamma: int, *, local_draft: bool = False
    ) -> float:
        """``score(gamma)`` of a round that drafts (``gamma >= 1``)."""
        cm = self.cost_model
        expected = acceptance.expected_tokens(gamma)
        charge = self.waste_charge(load) * cm.verify_ns_per_position()
        cost = cm.round_ns(gamma, self.batch_size(load), drafted=not local_draft) + charge * (
            gamma + 1 - expected
        )
        return expected / max(cost, 1.0)

    def tree_min_path_probability(
        self, acceptance: AcceptanceTracker, load: LoadSnapshot, gamma: int
    ) -> float:
        """The break-even of one more node in a round of ``gamma`` drafted tokens, times :data:`TREE_MARGIN`.

        The node costs one more verified position at the round's ``P = b (gamma + 1)`` positions
        (:meth:`CostModel.position_ns`: the fit's marginal, or the target's measured curve's steepest rise from
        there on where that is more), plus the waste charge for the batch-mates it delays and its row on the
        wire both ways; it adds its chance of acceptance to the round's committed tokens, which the round buys
        at ``score(gamma)`` tokens per ns. So it pays when that chance is at least the cost times
        ``score(gamma)``: a position's cost as a fraction of a committed token's, never less than its fraction of
        a target step where the policy drafts. The draft's path probability stands in for the chance, with the
        margin; 1 (a chain) before the cost model has data, and never below :data:`TREE_FLOOR`.
        """
        cm = self.cost_model
        if gamma == 0 or not cm.ready_for(drafted=True):
            return 1.0
        b = self.batch_size(load)
        positions = b * (gamma + 1)
        cost = cm.position_ns(b, positions)
        cost += self.waste_charge(load) * cm.verify_ns_per_position() + 2 * (cm.rtt_ns(1) - cm.rtt_ns(0))
        score = self._drafted_score(acceptance, load, gamma)
        return min(1.0, max(TREE_FLOOR, TREE_MARGIN * max(cost, 0.0) * score))

    def tree_expand_min_path_probability(
        self, acceptance: AcceptanceTracker, load: LoadSnapshot, gamma: int
    ) -> float:
        """The break-even of an expansion pass, times :data:`TREE_MARGIN`: the draft pass that expands a level
        (:meth:`CostModel.expansion_pass_ns`, learnt from the Propose calls' ``expansion_passes``) delays the round
        by its time, and what it can add is at most the summed path probabilities of the alternatives it expands
        (each one's children's chances sum to no more than its own). So the pass pays when that sum is at least
        the pass's cost times ``score(gamma)``. 1 (no expansion) before the cost model has data or where the
        proposal is a chain; never below :meth:`tree_min_path_probability`'s threshold."""
        node = self.tree_min_path_probability(acceptance, load, gamma)
        if node >= 1.0:
            return 1.0
        cost = self.cost_model.expansion_pass_ns()
        score = self._drafted_score(acceptance, load, gamma)
        return min(1.0, max(node, TREE_MARGIN * max(cost, 0.0) * score))

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
        target_only_steps: int | None = None,
    ) -> int:
        last = acceptance.last_gamma
        ready = self.cost_model.ready_for(drafted=not local_draft)
        if last is None:  # the first round: cautious, unless other sessions' rounds back the prior
            top = len(self.choices) - 1 if acceptance.warm_start and ready else self._rung(self.initial_gamma)
            if ready:
                scores = self.scores(
                    acceptance, load, local_draft=local_draft, target_only_steps=target_only_steps
                )
                choice = max(self.choices[: top + 1], key=lambda g: scores[g])
            else:
                choice = self.choices[top]
            return self._record(acceptance, choice)
        current = self.choices[self._rung(last)]
        if not ready:
            return self._record(acceptance, current)
        scores = self.scores(acceptance, load, local_draft=local_draft, target_only_steps=target_only_steps)
        # Up one rung at most, down any (a proposer in the coordinator: any; docs/design.md, "Bounds").
        allowed = self.choices if local_draft else self.choices[: self._rung(current) + 2]
        best = max(allowed, key=lambda g: scores[g])  # ties: the smaller gamma
        if best != current and scores[best] <= scores[current] * (1.0 + self.switch_margin):
            best = current
        if acceptance.probing:
            acceptance.probing = False
            if acceptance.last_accepted == 0:  # back off at the second fruitless probe in a row
                acceptance.fruitless_probes += 1
                if acceptance.fruitless_probes >= 2:
                    acceptance.probe_interval = min(2 * self._interval(acceptance), self.max_probe_interval)
            else:  # promising, if not yet enough: come back sooner
                acceptance.fruitless_probes = 0
                acceptance.probe_interval = max(self._interval(acceptance) // 2, self.probe_interval or 1)
        if best == 0 and self.probe_interval is not None and len(self.choices) > 1:
            if acceptance.rounds_at_zero >= self._interval(acceptance) * self.batch_size(load):
                acceptance.probing = True
                best = self.choices[1]
        elif best > 0 and not acceptance.probing:
            acceptance.probe_interval = None
            acceptance.fruitless_probes = 0
        return self._record(acceptance, best)

    def _interval(self, acceptance: AcceptanceTracker) -> int:
        base = self.probe_interval if self.probe_interval is not None else 0
        return acceptance.probe_interval if acceptance.probe_interval is not None else base

    @staticmethod
    def _record(acceptance: AcceptanceTracker, gamma: int) -> int:
        acceptance.rounds_at_zero = acceptance.rounds_at_zero + 1 if gamma == 0 else 0
        acceptance.last_gamma = gamma
        return gamma
