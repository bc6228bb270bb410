"""The opt-in ``tree`` source (``specserve/coordinator/speculation/sources/tree.py``): where it is built, the tree it
makes of the draft's chain and the lookup's continuation, and that tree's wire form (pure Python, no servers; the
system tests are ``test_rounds_trees.py``)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from worker_fakes import speculator_for

from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.coordinator.fleet.clients import _verify_item
from specserve.coordinator.messages import Proposal, VerifyRequest
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.policy import FixedGamma, LoadSnapshot
from specserve.coordinator.speculation.source import Source
from specserve.coordinator.speculation.sources.ngram import HybridLookup
from specserve.coordinator.speculation.sources.tree import ModelLookupTree
from specserve.coordinator.speculation.speculator import Plan, Speculator
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.core.tree import DraftTree
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit


def _session(proposer=common_pb2.PROPOSER_KIND_MODEL) -> Session:
    speculation = SpeculationSettings(gamma=None, proposer=proposer)
    return Session("s", [5, 6, 7, 8, 5, 6], SamplingParams(temperature=0.0), StopConditions(), speculation)


def test_built_in_place_of_the_draft_model_only_where_opted_in():
    assert speculator_for(_session()).source("tree") is None
    opted = speculator_for(_session(), opt_in_sources=["tree"])
    assert isinstance(opted.source("tree"), ModelLookupTree) and opted.source("model") is None
    ngram = speculator_for(_session(common_pb2.PROPOSER_KIND_NGRAM), opt_in_sources=["tree"])
    assert ngram.source("tree") is None


def test_the_lookup_parts_from_the_chain_as_a_later_sibling():
    chain = Proposal((10, 11, 12), ("q0", "q1", "q2"), source="tree", wall_ns=5)
    tree = chain.with_branch((10, 20, 21))
    assert tree.token_ids == (10, 11, 12, 20, 21)
    assert tree.parents == (-1, 0, 1, 0, 3)  # 20 below 10, beside 11 (drawn first); 21 below 20
    assert tree.distributions == ("q0", "q1", "q2", None, None)  # the lookup's nodes are point masses
    assert tree.depth == 3 and tree.wall_ns == 5 and tree.source == "tree"
    DraftTree(tree.token_ids, tree.parents)  # a valid tree: distinct siblings, parents before children
    at_root = Proposal((10, 11)).with_branch((30, 31, 32))
    assert at_root.parents == (-1, 0, -1, 2, 3) and at_root.distributions == ()
    assert at_root.depth == 3


def test_a_lookup_within_the_chain_adds_nothing_and_one_past_it_continues_the_chain():
    chain = Proposal((10, 11, 12), ("q0", "q1", "q2"))
    assert chain.with_branch((10, 11)) is chain and chain.with_branch(()) is chain
    longer = chain.with_branch((10, 11, 12, 13))
    assert longer.token_ids == (10, 11, 12, 13) and longer.parents == (-1, 0, 1, 2)  # a chain, as parents
    assert Proposal().with_branch((4, 5)).parents == (-1, 0)


def test_the_wire_form_carries_parents_and_writes_point_masses_out():
    q = common_pb2.DraftDistribution(
        sparse=common_pb2.SparseDistribution(token_ids=[10, 3], probs=[0.75, 0.25])
    )
    tree = Proposal((10,), (q,)).with_branch((20,))
    item = _verify_item(VerifyRequest(SessionBase("s", 3, 1), tree))
    assert list(item.proposal.parents) == [-1, -1]
    assert item.proposal.distributions[0] == q
    point = item.proposal.distributions[1].sparse
    assert list(point.token_ids) == [20] and list(point.probs) == [1.0]
    chain = _verify_item(VerifyRequest(SessionBase("s", 3, 1), Proposal((10, 11))))
    assert not chain.proposal.parents and not chain.proposal.distributions


def test_a_lookup_walks_down_through_an_alternative_and_hangs_the_rest_below_it():
    # The head's tree: chain 10 -> 11 -> 12, runner-up 20 beside 10 and 21 beside 11 (point masses).
    tree = Proposal((10, 11, 12, 20, 21), ("q0", "q1", "q2", None, None), parents=(-1, 0, 1, -1, 0))
    branched = tree.with_branch((20, 30, 31))
    assert branched.token_ids == (10, 11, 12, 20, 21, 30, 31)
    assert branched.parents == (-1, 0, 1, -1, 0, 3, 5)  # 30 below the alternative 20, 31 below 30
    assert branched.distributions == ("q0", "q1", "q2", None, None, None, None)
    DraftTree(branched.token_ids, branched.parents)
    through = tree.with_branch((10, 21, 40))  # through the chain's 10, then the alternative 21
    assert through.token_ids[-1] == 40 and through.parents[-1] == 4
    assert tree.with_branch((10, 21)) is tree  # nothing new


def test_a_branch_takes_no_more_than_its_room():
    chain = Proposal((10, 11))
    assert chain.with_branch((30, 31, 32), room=2).token_ids == (10, 11, 30, 31)
    assert chain.with_branch((30, 31, 32), room=0) is chain


class _TreeDrafter(Source):
    """A drafter of trees (as the feature head is) whose every round is the same tree: chain 10 -> 11 and the
    runner-up 20 beside 10."""

    name = "feature"
    free = False
    trees = True

    @classmethod
    def build(cls, setup):  # pragma: no cover - built by hand here
        return None

    def ready(self) -> bool:
        return True

    async def propose(self, gamma: int, tree: TreeBudget = CHAIN) -> Proposal:
        if tree.branches:
            return Proposal((10, 11, 20), ("q0", "q1", None), parents=(-1, 0, -1))
        return Proposal((10, 11), ("q0", "q1"))


class _Fleet:
    def load(self) -> LoadSnapshot:
        return LoadSnapshot(1, 0.0, 0)

    def bind_round(self, session) -> None:
        return None


def _speculator(lookup: HybridLookup, **fields) -> Speculator:
    session = _session(common_pb2.PROPOSER_KIND_FEATURE)
    fields = {"tree_nodes": 4, "tree_min_path_probability": 0.0, **fields}
    return Speculator(session, [lookup, _TreeDrafter()], fleet=_Fleet(), policy=FixedGamma(2), max_gamma=8, **fields)


async def test_the_lookup_hangs_its_guess_on_the_drafters_tree():
    lookup = HybridLookup([5, 6, 7, 8, 5, 6])  # its guess after ... 5, 6: 7, 8
    speculator = _speculator(lookup)
    before = REGISTRY.get_sample_value("specserve_coordinator_branch_nodes_total", {"source": "ngram"}) or 0.0
    plan = speculator.plan()
    assert plan.source is None and plan.tree == TreeBudget(6, 0.0)  # unmatched, the lookup drafts no round itself
    tree = await speculator.propose(plan)
    assert tree.token_ids == (10, 11, 20, 7, 8) and tree.parents == (-1, 0, -1, -1, 3)
    assert tree.distributions == ("q0", "q1", None, None, None) and tree.source == "feature"
    after = REGISTRY.get_sample_value("specserve_coordinator_branch_nodes_total", {"source": "ngram"})
    assert after == before + 2


async def test_no_branch_where_the_round_does_not_branch_or_the_lookup_is_below_the_threshold():
    lookup = HybridLookup([5, 6, 7, 8, 5, 6])
    chains = _speculator(lookup, tree_nodes=0)
    assert (await chains.propose(Plan(2))).token_ids == (10, 11)  # a chain round stays a chain
    strict = _speculator(lookup)
    assert lookup.tracker.alpha() < 0.5  # its prior
    assert (await strict.propose(Plan(2, tree=TreeBudget(6, 0.5)))).token_ids == (10, 11, 20)
    for _ in range(20):
        lookup.learn(proposed=2, accepted=2)  # its guesses keep matching
    alpha = lookup.tracker.alpha()
    assert (await strict.propose(Plan(2, tree=TreeBudget(6, alpha**2)))).token_ids == (10, 11, 20, 7, 8)
    # The second node's chance (alpha squared) is below the threshold: the branch stops at one node.
    assert (await strict.propose(Plan(2, tree=TreeBudget(6, alpha**1.5)))).token_ids == (10, 11, 20, 7)
    # The draft's alternatives fill the node budget; the branch is priced on its own.
    assert (await strict.propose(Plan(2, tree=TreeBudget(3, 0.0)))).token_ids == (10, 11, 20, 7, 8)
