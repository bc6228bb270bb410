"""The speculator's plan of a round's tree (``specserve/coordinator/speculation/speculator.py``; pure Python, no
servers): which sessions may branch, and how far."""

from __future__ import annotations

import pytest
from worker_fakes import speculator_for

from specserve.api.constraints import Constraint
from specserve.api.params import SamplingParams, StopConditions
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.policy import (
    AdaptiveGamma,
    CostModel,
    CostPrior,
    FixedGamma,
    LoadSnapshot,
)
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

FEATURE = common_pb2.PROPOSER_KIND_FEATURE
MODEL = common_pb2.PROPOSER_KIND_MODEL


class IdleFleet:
    """A fake fleet, named as such: one idle session (the plan asks nothing else of it)."""

    def load(self) -> LoadSnapshot:
        return LoadSnapshot.idle()


def _session(proposer: int = FEATURE, constraint: Constraint | None = None) -> Session:
    sampling = SamplingParams(temperature=0.0, constraint=constraint)
    speculation = SpeculationSettings(gamma=None, proposer=proposer)
    return Session("s", [5, 6, 7, 8], sampling, StopConditions(max_new_tokens=64), speculation)


def _flat_costs() -> CostModel:
    """A cost model that has seen calls on an accelerator's flat curve (a position: 2% of a step)."""
    step = 20e6
    curve = tuple(step * (1 + 0.02 * k) for k in range(9))
    cm = CostModel(prior=CostPrior(verify_curve=curve))
    for gamma in range(1, 9):
        cm.observe_draft(tokens=gamma, ns=int(0.1 * step * gamma))
        cm.observe_verify(batch_size=1, positions=gamma + 1, ns=int(curve[gamma]))
    return cm


def test_a_feature_session_under_the_adaptive_policy_branches_at_the_policys_price():
    policy = AdaptiveGamma(_flat_costs())
    spec = speculator_for(_session(), pool=IdleFleet(), policy=policy, draft_tree_nodes=6)
    plan = spec.plan()
    assert plan.gamma > 0 and plan.tree.branches
    want = policy.tree_min_path_probability(spec.tracker, LoadSnapshot.idle(), plan.gamma)
    assert plan.tree == TreeBudget(plan.gamma + 6, want)


@pytest.mark.parametrize(
    ("session", "settings"),
    [
        (_session(constraint=Constraint("regex", "[a-z]+")), {}),
        (_session(MODEL), {}),
        (_session(), {"draft_tree_nodes": 0}),
    ],
    ids=["constrained", "token-draft", "trees-off"],
)
def test_constrained_sessions_the_token_draft_and_trees_off_draft_chains(session, settings):
    spec = speculator_for(session, pool=IdleFleet(), policy=AdaptiveGamma(_flat_costs()), **settings)
    plan = spec.plan()
    assert plan.gamma > 0 and plan.tree == CHAIN


def test_a_fixed_gamma_drafts_chains_unless_the_threshold_is_fixed():
    assert speculator_for(_session(), pool=IdleFleet(), policy=FixedGamma(4)).plan().tree == CHAIN
    settings = {"draft_tree_nodes": 5, "draft_tree_min_path_probability": 0.05}
    fixed = speculator_for(_session(), pool=IdleFleet(), policy=FixedGamma(4), **settings)
    assert fixed.plan().tree == TreeBudget(9, 0.05)
    assert speculator_for(_session(), pool=IdleFleet(), policy=FixedGamma(0)).plan().tree == CHAIN
