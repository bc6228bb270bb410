"""specserve.draft.feature_proposer: the feature head's context per session, its features protocol, batches."""

from __future__ import annotations

import copy
import dataclasses

import grpc
import pytest
import tiny_models
import torch
from draft_helpers import draft_settings
from transformers import DynamicCache

from specserve.api.params import SamplingParams, SessionBase
from specserve.core import features as wire
from specserve.core.proposal import draft_probs_to_pb
from specserve.core.ranked_tree import CHAIN, TreeBudget, grow_tree, score_candidates
from specserve.core.tree import DraftTree
from specserve.draft.feature_proposer import FeatureProposer
from specserve.draft.proposers import Drafted, DraftRequest
from specserve.draft.server import start_draft
from specserve.engine.feature_head import FinalNormInput, head_from_target, save_feature_head, target_features
from specserve.engine.kvcache import SessionCacheStore
from specserve.engine.models import load_model
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("feature_pair"), seed=5)
    return load_model(target_dir, device="cpu", dtype="float32").model


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(3)
    head = head_from_target(target, torch.arange(0, target.config.vocab_size, 2))
    with torch.no_grad():  # away from the initialisation, so that every part of the head matters
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return head.eval()


def _proposer(head) -> FeatureProposer:
    return FeatureProposer(head, SessionCacheStore(head, max_sessions=64, budget_bytes=10**9, ttl_s=600))


@torch.no_grad()
def _features(target, tokens) -> wire.FeatureBlock:
    """The target's features of positions [0, len(tokens) - 1), as the target ships them."""
    with FinalNormInput(target) as tap:
        target(input_ids=torch.tensor([list(tokens[:-1])]))
    return wire.encode(target_features(tap.hidden[0], target.config.rms_norm_eps), 0)


def _wire(drafted) -> list[bytes] | None:
    if drafted.probs_f32 is None:
        return None
    return [d.SerializeToString() for d in draft_probs_to_pb(drafted.probs_f32, drafted.sparse)]


def _requests(target) -> list[DraftRequest]:
    """Eight sessions: mixed prompt lengths (two above the inline catch-up limit), gammas, greedy and sampled."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i, (n, gamma) in enumerate(zip((3, 40, 7, 70, 2, 15, 50, 9), (4, 1, 6, 3, 5, 2, 4, 4), strict=True)):
        committed = tuple(torch.randint(1, target.config.vocab_size, (n,), generator=gen).tolist())
        params = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.8, seed=40 + i)
        out.append(
            DraftRequest(f"s{i}", committed, gamma, params, params.seed or 0, features=_features(target, committed))
        )
    return out


def _next_round(target, request: DraftRequest, drafted: Drafted) -> DraftRequest:
    """The round after: the first drafted token and a correction committed; the new features only."""
    committed = (*request.committed, *drafted.token_ids[:1], 3)
    block = _features(target, committed)
    new = block.slice(len(request.committed) - 1, len(committed) - 1)
    return DraftRequest(
        request.session_id, committed, request.gamma, request.sampling, request.seed, features=new, tree=request.tree
    )


@pytest.mark.unit
@pytest.mark.parametrize("tree", [CHAIN, TreeBudget(12, 0.01)], ids=["chains", "trees"])
def test_eight_sessions_in_one_batch_equal_each_drafted_alone(target, head, tree):
    """Token for token, with the same q bytes, in two rounds (the second with only the new features); with a
    tree budget, the same trees (the head's runners-up, never a token outside the head's vocabulary)."""
    alone, batched = _proposer(head), _proposer(head)
    requests = [dataclasses.replace(r, tree=tree) for r in _requests(target)]
    branched = 0
    for round_ in range(2):
        by_alone = [alone.propose(r) for r in requests]
        by_batch = batched.propose_batch(requests)
        for r, a, b in zip(requests, by_alone, by_batch, strict=True):
            assert isinstance(b, Drafted)
            assert (b.token_ids, b.parents) == (a.token_ids, a.parents), f"round {round_}, {r.session_id}"
            assert _wire(b) == _wire(a), f"round {round_}, {r.session_id}: q bytes differ"
            shape = DraftTree(a.token_ids, a.parents or tuple(range(-1, len(a.token_ids) - 1)))
            assert shape.max_depth == r.gamma and shape.nodes <= max(r.gamma, tree.max_nodes)
            assert set(a.token_ids) <= set(head.head_token_ids.tolist())
            assert (a.probs_f32 is None) == r.sampling.greedy
            branched += bool(a.parents)
        requests = [_next_round(target, r, a) for r, a in zip(requests, by_alone, strict=True)]
    assert (branched > 0) == tree.branches


@pytest.mark.unit
@torch.no_grad()
def test_greedy_drafts_are_the_heads_own_chain(target, head):
    """A greedy proposal is what the head gives run by hand: every true slot in one pass, then each drafted
    token fed back with the previous output as its feature."""
    committed = (9, 4, 30, 12, 7, 51, 8)
    block = _features(target, committed)
    drafted = _proposer(head).propose(
        DraftRequest("g", committed, 4, SamplingParams(temperature=0.0), 0, features=block)
    )
    feats = wire.decode(block)  # [n - 1, hidden]
    cache = DynamicCache(config=head.config)
    n = len(committed)
    step = head(torch.tensor([committed[1:]]), feats[None], position_ids=torch.arange(n - 1)[None], cache=cache)
    expected = []
    hidden, logits = step.hidden[:, -1:], step.logits[0, -1]
    for i in range(4):
        token = int(head.head_token_ids[logits.argmax()])
        expected.append(token)
        step = head(torch.tensor([[token]]), hidden, position_ids=torch.tensor([[n - 1 + i]]), cache=cache)
        hidden, logits = step.hidden, step.logits[0, -1]
    assert list(drafted.token_ids) == expected


@pytest.mark.unit
@torch.no_grad()
def test_a_greedy_tree_expands_below_its_best_alternatives_as_the_head_run_by_hand(target, head):
    """EAGLE-2's expansion: an alternative's slot takes the feature of the chain token beside it, after the
    chain's slots above it, a candidate below it the alternative's output, and the head's output at each
    ranks the candidates below it, level by level while a new candidate is among the best; the tree is
    ``grow_tree`` of the chain's candidates and those, best path first under the budget."""
    head = copy.deepcopy(head)
    with torch.no_grad():  # sharper: a child's path can outrank a runner-up deeper in the chain
        head.norm.weight.mul_(6.0)
    committed = (9, 4, 30, 12, 7, 51, 8)
    budget = TreeBudget(12, 0.0)
    gamma, n = 4, len(committed)
    block = _features(target, committed)
    drafted = _proposer(head).propose(
        DraftRequest("e", committed, gamma, SamplingParams(temperature=0.0), 0, features=block, tree=budget)
    )

    def ranked(logits: torch.Tensor, exclude: int, k: int) -> tuple:
        probs = torch.softmax(logits.double(), -1)
        order = sorted(range(probs.shape[0]), key=lambda t: (-float(probs[t]), t))
        return tuple((t, float(probs[t])) for t in order if t != exclude and probs[t] > 0)[:k]

    feats = wire.decode(block)  # [n - 1, hidden]
    cache = DynamicCache(config=head.config)
    step = head(torch.tensor([committed[1:]]), feats[None], position_ids=torch.arange(n - 1)[None], cache=cache)
    true_slots = copy.deepcopy(cache)
    inputs, chain, chain_probs, candidates = [], [], [], []
    hidden, logits = step.hidden[:, -1:], step.logits[0, -1]
    for i in range(gamma):
        full = head.scatter(logits[None])[0]  # [vocab]
        token = int(full.argmax())
        inputs.append(hidden)
        chain.append(token)
        chain_probs.append(float(torch.softmax(full.double(), -1)[token]))
        candidates.append(ranked(full, token, budget.max_nodes - 1))
        step = head(torch.tensor([[token]]), hidden, position_ids=torch.tensor([[n - 1 + i]]), cache=cache)
        hidden, logits = step.hidden, step.logits[0, -1]
    room = budget.max_nodes - gamma
    below: dict = {}
    frontier = [(d, r) for d, listed in enumerate(candidates) for r in range(len(listed))]
    levels = 0
    while True:  # each level: the new candidates among the best room - 1 so far, above the chain's last depth
        best = score_candidates(chain_probs, candidates, budget, below)[: room - 1]
        picks = [key for _, depth, key, _ in best if key in frontier and depth < gamma - 1]
        if not picks:
            break
        levels += 1
        frontier = []
        for key in picks:  # the head along the candidate's path, one slot at a time
            by_hand = copy.deepcopy(true_slots)
            d = key[0]
            for i in range(d):
                head(torch.tensor([[chain[i]]]), inputs[i], position_ids=torch.tensor([[n - 1 + i]]), cache=by_hand)
            path, feature = [candidates[d][key[1]][0]], inputs[d]
            for depth in range(2, len(key)):
                path.append(below[key[:depth]][key[depth]][0])
            for i, token in enumerate(path):
                out = head(
                    torch.tensor([[token]]), feature, position_ids=torch.tensor([[n - 1 + d + i]]), cache=by_hand
                )
                feature = out.hidden
            below[key] = ranked(head.scatter(out.logits[0, -1:])[0], -1, room - 1)
            frontier += [(*key, c) for c in range(len(below[key]))]
    expected = grow_tree(chain, chain_probs, candidates, budget, below)
    assert (drafted.token_ids, drafted.parents) == expected
    assert any(p >= gamma for p in drafted.parents), "no node below an alternative: the test shows nothing"
    assert levels >= 2, "one level of expansion only: the test shows less than it claims"
    assert expected != grow_tree(chain, chain_probs, candidates, budget)  # the expansion changed the tree
    assert drafted.expansion_passes == levels  # what the cost model prices apart from the chain's tokens


@pytest.mark.unit
def test_the_expansion_threshold_decides_which_levels_cost_a_pass(target, head, monkeypatch):
    """``TreeBudget.expand_min_path_probability``: 0 expands as before; 1 keeps every alternative a leaf, in no
    extra pass; one between the levels' summed path probabilities (read where the proposer picks a level's
    candidates) runs only the passes whose picks sum to it or more, and the draft counts the passes it ran."""
    from specserve.draft import feature_proposer, proposers

    head = copy.deepcopy(head)
    with torch.no_grad():  # as in the test above: a tree that expands at two levels
        head.norm.weight.mul_(6.0)
    committed = (9, 4, 30, 12, 7, 51, 8)
    gamma, block = 4, _features(target, committed)
    levels: list[float] = []  # the summed path probability of each level the last draft expanded

    def expandable(row, frontier):
        keys = proposers.expandable(row, frontier)
        scored = score_candidates(row.chain_probs, row.candidates, row.request.tree, row.below)
        if keys:
            levels.append(sum(-score for score, _, key, _ in scored if key in keys))
        return keys

    monkeypatch.setattr(feature_proposer, "expandable", expandable)

    def draft(expand: float) -> tuple[Drafted, list[float]]:
        levels.clear()
        budget = TreeBudget(12, 0.0, expand)
        request = DraftRequest("x", committed, gamma, SamplingParams(temperature=0.0), 0, features=block, tree=budget)
        return _proposer(head).propose(request), list(levels)

    (free, free_levels), (leaves, none) = draft(0.0), draft(1.0)
    assert free.expansion_passes == len(free_levels) >= 2 and any(p >= gamma for p in free.parents)
    assert leaves.expansion_passes == 0 and not none and all(p < gamma for p in leaves.parents)
    assert leaves.token_ids[:gamma] == free.token_ids[:gamma] and len(leaves.token_ids) > gamma  # alternatives: leaves
    threshold = (min(free_levels) + max(free_levels)) / 2  # the first level passes it, the last does not
    assert free_levels[0] >= threshold > free_levels[-1]
    between, passed = draft(threshold)
    assert passed and min(passed) >= threshold and between.expansion_passes == len(passed) < len(free_levels)
    assert (between.token_ids, between.parents) not in ((free.token_ids, free.parents), (leaves.token_ids, leaves.parents))


@pytest.mark.unit
def test_missing_features_are_named_by_position_and_a_reset_rebuilds(target, head):
    proposer = _proposer(head)
    committed = tuple(range(1, 30))
    full = _features(target, committed)
    params = SamplingParams(temperature=0.0)
    bare = proposer.propose(DraftRequest("w", committed, 3, params, 0))
    assert (bare.token_ids, bare.features_needed_from) == ((), 0)  # nothing held, nothing cached: all of them
    assert len(proposer.propose(DraftRequest("w", committed[:20], 3, params, 0, features=full.slice(0, 19))).token_ids) == 3
    # Features that skip positions 19..24: the head says where they must start.
    gap = proposer.propose(DraftRequest("w", committed, 3, params, 0, features=full.slice(25, 28)))
    assert (gap.token_ids, gap.features_needed_from) == ((), 19)
    # A window of recent features with reset: a context of its own, drafted from at once.
    window = proposer.propose(
        DraftRequest("w", committed, 3, params, 0, features=full.slice(20, 28), features_reset=True)
    )
    assert len(window.token_ids) == 3
    fresh = _proposer(head).propose(
        DraftRequest("x", committed, 3, params, 0, features=full.slice(20, 28), features_reset=True)
    )
    assert window.token_ids == fresh.token_ids


@pytest.mark.unit
def test_features_that_end_early_are_fed_and_the_rest_named_then_drafted_from(target, head):
    """Bounded messages (issue 54): features in pieces build the same context as at once; each piece that
    does not reach the last committed token's predecessor drafts nothing and names where the next starts."""
    committed = tuple((5 * i) % 300 + 2 for i in range(60))
    full = _features(target, committed)
    params = SamplingParams(temperature=0.0)
    proposer = _proposer(head)
    for start, stop in ((0, 20), (20, 41)):
        part = proposer.propose(DraftRequest("p", committed, 4, params, 0, features=full.slice(start, stop)))
        assert (part.token_ids, part.features_needed_from, part.prefill_tokens) == ((), stop, stop - start)
    last = proposer.propose(DraftRequest("p", committed, 4, params, 0, features=full.slice(41, 59)))
    whole = _proposer(head).propose(DraftRequest("q", committed, 4, params, 0, features=full))
    assert last.features_needed_from is None and last.token_ids == whole.token_ids and len(whole.token_ids) == 4


@pytest.mark.unit
def test_a_new_session_takes_the_heads_context_of_its_history_from_the_prefix_cache(target, head):
    """The prefix cache with the head (issue 53): the next turn of a conversation attaches the head's true
    slots of the shared history, so it needs only the features after them, and drafts what a head given
    every feature drafts."""
    params = SamplingParams(temperature=0.0)
    turn1 = tuple((7 * i) % 300 + 2 for i in range(40))
    proposer = _proposer(head)
    proposer.propose(DraftRequest("t1", turn1, 4, params, 0, features=_features(target, turn1)))
    turn2 = (*turn1, 9, 8, 7, 6)
    full = _features(target, turn2)
    asked = proposer.propose(DraftRequest("t2", turn2, 4, params, 0))
    assert asked.features_needed_from == 32  # slots 1..32: two whole blocks of the 39 turn 1 held
    drafted = proposer.propose(DraftRequest("t2", turn2, 4, params, 0, features=full.slice(32, len(turn2) - 1)))
    alone = _proposer(head).propose(DraftRequest("t2", turn2, 4, params, 0, features=full))
    assert drafted.token_ids == alone.token_ids and len(alone.token_ids) == 4
    # A different first token: its slots read another feature of position 0, so nothing is attached.
    other = proposer.propose(DraftRequest("t3", (1, *turn2[1:]), 4, params, 0))
    assert other.features_needed_from == 0
    # Another tenant's session (its own cache scope, issue 54 finding 1) attaches nothing of this history.
    tenant = proposer.propose(DraftRequest("t4", turn2, 4, params, 0, cache_scope=b"other"))
    assert tenant.features_needed_from == 0


@pytest.mark.unit
def test_the_heads_caches_count_against_the_draft_models_budget(target, head):
    """One kv_budget_bytes for the draft model's and the head's caches (issue 54, finding 5): the head's
    growth evicts the model store's older sessions."""
    from specserve.engine.kvcache import KVBudget

    budget = KVBudget(10**9)
    model_store = SessionCacheStore(target, max_sessions=64, budget_bytes=budget, ttl_s=600)
    old, _ = model_store.get_or_create("old")
    old.reconcile([5, 6, 7, 8, 9])
    proposer = FeatureProposer(head, SessionCacheStore(head, max_sessions=64, budget_bytes=budget, ttl_s=600))
    committed = tuple(range(2, 40))
    proposer.propose(DraftRequest("h", committed, 3, SamplingParams(temperature=0.0), 0, features=_features(target, committed)))
    budget.budget_bytes = budget.total_bytes - 1
    proposer.propose(DraftRequest("h", committed, 3, SamplingParams(temperature=0.0), 0))
    assert "old" not in model_store and proposer.holds("h")


@pytest.mark.unit
def test_a_repeated_propose_needs_no_features_and_drafts_the_same(target, head):
    """A retried Propose (nothing new committed) feeds the last true slot again from what the head kept: the
    same draft (``q`` to float rounding: a one-slot pass reduces in another order than the first call's
    six-slot pass)."""
    proposer = _proposer(head)
    committed = (5, 6, 7, 8, 9, 10)
    params = SamplingParams(temperature=0.7, seed=3)
    first = proposer.propose(DraftRequest("r", committed, 4, params, 3, features=_features(target, committed)))
    again = proposer.propose(DraftRequest("r", committed, 4, params, 3))
    assert again.token_ids == first.token_ids
    torch.testing.assert_close(again.probs_f32, first.probs_f32, atol=1e-6, rtol=1e-5)


# ---- through the draft server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory, target, head):
    """A pair on disk and the head saved beside it: (target_dir, draft_dir, head_dir)."""
    root = tmp_path_factory.mktemp("feature_server")
    target_dir, draft_dir = tiny_models.make_tiny_pair(root, seed=5)
    save_feature_head(head, root / "head", dtype=torch.float32)
    return target_dir, draft_dir, root / "head"


@pytest.mark.system
async def test_the_draft_server_serves_the_head_and_names_the_features_an_item_lacks(head_dirs, target, head):
    target_dir, draft_dir, head_dir = head_dirs
    app = await start_draft(
        draft_settings(model=str(draft_dir), feature_head=str(head_dir), feature_head_target=str(target_dir))
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            committed = (4, 8, 15, 16, 23, 42)
            item = draft_pb2.ProposeRequest(
                base=SessionBase("h", len(committed), 0).to_pb(),
                start_position=0,
                token_ids=committed,
                sampling=SamplingParams(temperature=0.0).to_pb(),
                gamma=3,
                proposer=common_pb2.PROPOSER_KIND_FEATURE,
            )
            bare = draft_pb2.ProposeRequest()
            bare.CopyFrom(item)
            bare.base.session_id = "bare"
            item.features.CopyFrom(_features(target, committed).to_pb())
            reply = await stub.ProposeBatch(draft_pb2.ProposeBatchRequest(items=[item, bare]))
            info = await stub.GetDraftInfo(draft_pb2.GetDraftInfoRequest())
        expected = _proposer(head).propose(
            DraftRequest("h", committed, 3, SamplingParams(temperature=0.0), 0, features=_features(target, committed))
        )
        assert list(reply.results[0].proposal.proposal.token_ids) == list(expected.token_ids)
        assert not reply.results[0].proposal.HasField("features_needed_from")
        assert not reply.results[1].proposal.proposal.token_ids
        assert reply.results[1].proposal.features_needed_from == 0  # no features: it names the first it needs
        assert list(info.proposers) == [common_pb2.PROPOSER_KIND_MODEL, common_pb2.PROPOSER_KIND_FEATURE]
    finally:
        await app.stop(0)
