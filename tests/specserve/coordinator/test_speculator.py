"""The speculator's plan of a round's tree (``specserve/coordinator/speculation/speculator.py``; pure Python, no
servers): which sessions may branch, and how far."""

from __future__ import annotations

import pytest
from worker_fakes import speculator_for

from specserve.api.constraints import Constraint
from specserve.api.params import SamplingParams, StopConditions
from specserve.coordinator.messages import Proposal
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
    expand = policy.tree_expand_min_path_probability(spec.tracker, LoadSnapshot.idle(), plan.gamma)
    assert want <= expand < 1.0  # a draft pass of a fifth of a step: an expansion must promise more than a node
    assert plan.tree == TreeBudget(plan.gamma + 6, want, expand)


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


def _costly_draft() -> CostModel:
    """A CPU-like pair whose draft never pays: a draft token costs as much as a target step."""
    step = 20e6
    cm = CostModel()
    for k in range(1, 10):
        cm.observe_verify(batch_size=1, positions=k, ns=int(step * (1 + 0.1 * (k - 1))))
        cm.observe_draft(tokens=k, ns=int(step * k))
        cm.observe_rtt(ns=500_000)
    return cm


def _past_the_first_token(max_new_tokens: int = 64) -> Session:
    session = Session(
        "s", [5, 6, 7, 8], SamplingParams(temperature=0.0), StopConditions(max_new_tokens=max_new_tokens),
        SpeculationSettings(gamma=None, proposer=MODEL),
    )  # fmt: skip
    session.advance([9], start=4, version=1, finish_reason=0)
    return session


def test_a_probe_round_goes_on_with_a_gamma_zero_rounds_target_steps():
    """A round the policy drafts only to probe out of gamma 0 asks for the ``decode_steps`` a gamma-0 round would
    (capped by the tokens left after its proposal), so it costs its drafted positions, not a round of one or
    two tokens; a round the policy drafts because drafting pays asks for one step (its verdict decides the
    next round); a probe's draft is not drafted ahead beside its verify."""
    policy = AdaptiveGamma(_costly_draft())
    spec = speculator_for(_past_the_first_token(), pool=IdleFleet(), policy=policy, decode_steps=4)
    spec.tracker.last_gamma = 0
    assert spec.plan().gamma == 0 and not spec.plan().probe  # drafting does not pay here
    spec.tracker.rounds_at_zero = 8  # the probe clock's interval
    plan = spec.plan()
    assert plan.gamma == 1 and plan.probe
    request = spec.request(plan, Proposal((3,)))
    assert request.decode_steps == 4
    assert spec.plan().gamma == 0  # the probe found nothing the policy prices above gamma 0

    short = speculator_for(_past_the_first_token(max_new_tokens=4), pool=IdleFleet(), policy=policy, decode_steps=4)
    short.tracker.last_gamma, short.tracker.rounds_at_zero = 0, 8
    plan = short.plan()
    assert plan.probe and short.request(plan, Proposal((3,))).decode_steps == 2  # 3 tokens left, 1 proposed

    fixed = speculator_for(_past_the_first_token(), pool=IdleFleet(), policy=FixedGamma(2), decode_steps=4)
    plan = fixed.plan()
    assert plan.gamma == 2 and not plan.probe
    assert fixed.request(plan, Proposal((3, 4))).decode_steps == 1
    assert fixed.request(fixed.plan(), Proposal(())).decode_steps == 4
