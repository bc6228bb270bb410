"""The opt-in ``tree`` source (``specserve/coordinator/speculation/sources/tree.py``): where it is built, the tree it
makes of the draft's chain and the lookup's continuation, and that tree's wire form (pure Python, no servers; the
system tests are ``test_rounds_trees.py``)."""

from __future__ import annotations

import pytest
from worker_fakes import speculator_for

from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.coordinator.fleet.clients import _verify_item
from specserve.coordinator.messages import Proposal, VerifyRequest
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.sources.tree import ModelLookupTree, with_branch
from specserve.core.tree import DraftTree
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit


def _session(proposer=common_pb2.PROPOSER_KIND_MODEL) -> Session:
    speculation = SpeculationSettings(gamma=None, proposer=proposer)
    return Session("s", [5, 6, 7], SamplingParams(temperature=0.0), StopConditions(), speculation)


def test_built_in_place_of_the_draft_model_only_where_opted_in():
    assert speculator_for(_session()).source("tree") is None
    opted = speculator_for(_session(), opt_in_sources=["tree"])
    assert isinstance(opted.source("tree"), ModelLookupTree) and opted.source("model") is None
    ngram = speculator_for(_session(common_pb2.PROPOSER_KIND_NGRAM), opt_in_sources=["tree"])
    assert ngram.source("tree") is None


def test_the_lookup_parts_from_the_chain_as_a_later_sibling():
    chain = Proposal((10, 11, 12), ("q0", "q1", "q2"), source="tree", wall_ns=5)
    tree = with_branch(chain, (10, 20, 21))
    assert tree.token_ids == (10, 11, 12, 20, 21)
    assert tree.parents == (-1, 0, 1, 0, 3)  # 20 below 10, beside 11 (drawn first); 21 below 20
    assert tree.distributions == ("q0", "q1", "q2", None, None)  # the lookup's nodes are point masses
    assert tree.depth == 3 and tree.wall_ns == 5 and tree.source == "tree"
    DraftTree(tree.token_ids, tree.parents)  # a valid tree: distinct siblings, parents before children
    at_root = with_branch(Proposal((10, 11)), (30, 31, 32))
    assert at_root.parents == (-1, 0, -1, 2, 3) and at_root.distributions == ()
    assert at_root.depth == 3


def test_a_lookup_within_the_chain_adds_nothing_and_one_past_it_continues_the_chain():
    chain = Proposal((10, 11, 12), ("q0", "q1", "q2"))
    assert with_branch(chain, (10, 11)) is chain and with_branch(chain, ()) is chain
    longer = with_branch(chain, (10, 11, 12, 13))
    assert longer.token_ids == (10, 11, 12, 13) and longer.parents == (-1, 0, 1, 2)  # a chain, as parents
    assert with_branch(Proposal(), (4, 5)).parents == (-1, 0)


def test_the_wire_form_carries_parents_and_writes_point_masses_out():
    q = common_pb2.DraftDistribution(
        sparse=common_pb2.SparseDistribution(token_ids=[10, 3], probs=[0.75, 0.25])
    )
    tree = with_branch(Proposal((10,), (q,)), (20,))
    item = _verify_item(VerifyRequest(SessionBase("s", 3, 1), tree))
    assert list(item.proposal.parents) == [-1, -1]
    assert item.proposal.distributions[0] == q
    point = item.proposal.distributions[1].sparse
    assert list(point.token_ids) == [20] and list(point.probs) == [1.0]
    chain = _verify_item(VerifyRequest(SessionBase("s", 3, 1), Proposal((10, 11))))
    assert not chain.proposal.parents and not chain.proposal.distributions
