"""What the fleet's calls teach the cost model (:class:`~specserve.coordinator.speculation.cost_model.CostModel`).

Each Propose: the draft's time and its round trip. Each Verify call, once (through the one result that reports
it): the target's pass, its overhead beyond the passes and the round trip; each item: its wait in the batcher
(drafted or not). Statistics never fail a round: an observer that raises is logged.
"""

from __future__ import annotations

import structlog

from specserve.coordinator.messages import Proposal, Verified
from specserve.coordinator.speculation.cost_model import CostModel
from specserve.runtime import metrics

log = structlog.get_logger(__name__)


class CallCosts:
    """Feeds one cost model from the fleet's calls; keeps the recent Verify batch size (the policy's load)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.recent_batch = 1.0  # decaying mean Verify batch size

    def propose(self, proposal: Proposal) -> None:
        """A Propose call answered with ``proposal`` (``wall_ns``: the call as the coordinator saw it)."""
        assert proposal.draft_ns is not None
        if proposal.expansion_passes:
            metrics.DRAFT_EXPANSION_PASSES.inc(proposal.expansion_passes)
        self.cost_model.observe_draft(
            tokens=proposal.depth,
            ns=proposal.draft_ns,
            prefill_tokens=proposal.prefill_tokens,
            expansion_passes=proposal.expansion_passes,
        )
        self.cost_model.observe_rtt(
            ns=proposal.wall_ns - proposal.queue_ns - proposal.draft_ns, tokens=len(proposal.distributions)
        )

    def verify(self, verified: Verified, *, drafted: bool) -> None:
        """An item's wait in the batcher, and its Verify call's cost once (``drafted``: the round drafted with a
        Propose call first, for :meth:`CostModel.observe_queue`)."""
        cost = verified.cost
        b = cost.batch_size
        try:
            self.cost_model.observe_queue(drafted=drafted, batch_size=b, ns=cost.queue_ns)
        except Exception:  # statistics must never fail a round
            log.exception("batch_observer_failed")
        if not cost.reports_call:
            return
        try:
            # A call with several target steps ran passes one after another: not one pass over its positions.
            if cost.positions_processed >= b and cost.decode_steps == 1:
                self.cost_model.observe_verify(batch_size=b, positions=cost.positions_processed, ns=cost.verify_ns)
            if cost.forward_ns > 0:
                self.cost_model.observe_call_overhead(ns=cost.verify_ns, forward_ns=cost.forward_ns)
            self.cost_model.observe_rtt(ns=cost.call_ns - cost.verify_ns, tokens=cost.draft_tokens // max(b, 1))
        except Exception:  # statistics must never fail a round
            log.exception("batch_observer_failed")
        self.recent_batch = 0.9 * self.recent_batch + 0.1 * b
        metrics.VERIFY_BATCH_SIZE.observe(b)
