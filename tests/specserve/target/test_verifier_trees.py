"""specserve.target.verifier with draft trees: one pass, the tree rules, the accepted path's KV kept.

Real tiny Llama and GPT-2 targets in float32 and a real Redis, as test_verifier.py; reference values come
from fresh prefills of each node's path without any cache, and the rules of
:mod:`specserve.core.tree_verification` run by hand on them.
"""

from __future__ import annotations

import pytest
import torch
from target_helpers import (
    GREEDY,
    assert_cache_holds,
    fresh_logits,
    greedy_continuation,
    item,
    make_verifier,
    new_session,
    next_probs,
)

from specserve.api.errors import InvalidArgument
from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.core.proposal import DraftProposal, draft_probs_to_pb
from specserve.core.rng import gumbel_noise
from specserve.core.tree import MAX_TREE_NODES, DraftTree
from specserve.core.tree_verification import verify_tree
from specserve.target.messages import ItemToVerify, VerifyBatch
from specserve.target.servicer import batch_from_pb
from specserve.v1 import common_pb2, target_pb2

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11)


def tree_item(record, tree: DraftTree) -> ItemToVerify:
    base = SessionBase(record.session_id, record.committed_len, record.version)
    return ItemToVerify(base=base, proposal=DraftProposal(tree.tokens, tree.q), tree=tree)


def other(token: int, vocab: int, k: int = 1) -> int:
    return (token + 7 * k) % vocab


def greedy_tree(model, committed, depth: int, accept: int) -> DraftTree:
    """Two children per level along the target's greedy path (a wrong token first, the right one second) for the
    first ``accept`` levels, then wrong tokens only, and a wrong-rooted side branch of two nodes."""
    seq = list(committed)
    right = greedy_continuation(model, seq, depth)
    tokens, parents = [], []
    parent = -1
    for d in range(depth):
        good = right[d] if d < accept else other(right[d], model.vocab_size, 2)
        tokens += [other(right[d], model.vocab_size), good]
        parents += [parent, parent]
        parent = len(tokens) - 1
    tokens += [other(tokens[0], model.vocab_size), other(tokens[0], model.vocab_size, 3)]
    parents += [0, 0]  # below the first (wrong) child of the root
    return DraftTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("accept", [0, 2, 3])
async def test_greedy_tree_commits_the_targets_greedy_path_and_keeps_its_kv(target, store, accept):
    """Alone and beside a chain session: the verdict is target-only greedy decoding (the longest matching path
    then the argmax), the cache holds exactly the committed tokens (the other branches' KV dropped), and the next
    round (a chain) continues from it."""
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, GREEDY)
    mate = await new_session(store, PROMPT[::-1], GREEDY)
    for alone in (True, False):
        tree = greedy_tree(target, record.token_ids, 3, accept)
        items = (tree_item(record, tree),) if alone else (tree_item(record, tree), item(mate, (1, 2)))
        results = (await verifier.verify(VerifyBatch(items=items))).results
        verdict = results[0].verdict
        assert verdict is not None, results[0].error
        assert verdict.accepted_count == accept and verdict.bonus == (accept == 3)
        assert list(verdict.committed_token_ids) == greedy_continuation(target, record.token_ids, accept + 1)
        if not alone:
            assert results[1].verdict is not None
            assert_cache_holds(verifier, mate.session_id, (await store.load(mate.session_id)).token_ids)
        record = await store.load(record.session_id)
        assert_cache_holds(verifier, record.session_id, record.token_ids)
    chain = greedy_continuation(target, record.token_ids, 2)
    verdict = (await verifier.verify(VerifyBatch(items=(item(record, chain),)))).results[0].verdict
    assert list(verdict.committed_token_ids) == greedy_continuation(target, record.token_ids, 3)
    verifier.close()


def sampled_tree(target, draft, committed, params, gen) -> tuple[DraftTree, torch.Tensor]:
    """A tree drawn as a draft would: at the root 3 children without replacement from q, below the first two 2
    children each, q = half the draft's, half the target's distribution. Returns the tree and the target's rows
    ``[nodes + 1, vocab]`` from fresh prefills of each node's path."""
    tokens: list[int] = []
    parents: list[int] = []
    q_rows: list[torch.Tensor] = []
    paths: dict[int, list[int]] = {-1: list(committed)}

    def children(parent: int, k: int) -> None:
        seq = paths[parent]
        q = 0.5 * next_probs(draft, seq, params) + 0.5 * next_probs(target, seq, params)
        left = q.clone()
        for _ in range(k):
            token = int(torch.multinomial(left / left.sum(), 1, generator=gen))
            left[token] = 0.0
            tokens.append(token)
            parents.append(parent)
            q_rows.append(q)
            paths[len(tokens) - 1] = [*seq, token]

    children(-1, 3)
    children(0, 2)
    children(1, 2)
    tree = DraftTree(tuple(tokens), tuple(parents), torch.stack(q_rows))
    p = torch.stack([next_probs(target, paths[v], params) for v in range(-1, tree.nodes)])
    return tree, p


async def test_sampled_tree_verdicts_equal_the_rule_on_target_only_distributions(target, draft, store):
    """Over several rounds with every processor on (the repetition penalty sees each node's own path), each
    verdict equals ``verify_tree`` run by hand on fresh prefills' distributions, and the cache holds the log."""
    params = SamplingParams(temperature=0.9, top_k=60, top_p=0.9, repetition_penalty=1.3, seed=2024)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)
    gen = torch.Generator().manual_seed(5)
    depths = set()
    for _ in range(6):
        tree, p = sampled_tree(target, draft, record.token_ids, params, gen)
        want = verify_tree(p, tree, params.seed, record.committed_len)
        result = (await verifier.verify(VerifyBatch(items=(tree_item(record, tree),)))).results[0]
        assert result.verdict is not None, result.error
        assert result.verdict.committed_token_ids == want.emitted
        assert result.verdict.accepted_count == want.accepted and result.verdict.bonus == want.bonus
        depths.add(want.path[0] if want.path else -1)
        record = await store.load(record.session_id)
        assert_cache_holds(verifier, record.session_id, record.token_ids)
    assert len(depths) >= 2, f"first nodes taken {depths}: the rounds should take different branches"
    verifier.close()


async def test_coupled_tree_commits_target_only_gumbel_max(target, draft, store):
    """A coupled session's tree (the draft's Gumbel-top-2 at each of two levels) commits the target alone's
    ``argmax(log p_j + G_j)`` tokens, whatever the tree."""
    params = SamplingParams(temperature=0.9, top_k=60, seed=77, sampling_mode="coupled")
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)

    def gumbel_top(model, seq, k):
        scores = (
            next_probs(model, seq, params).log()
            + gumbel_noise([params.seed], [len(seq)], model.vocab_size)[0]
        )
        return [int(t) for t in torch.topk(scores, k).indices]

    for _ in range(4):
        seq = list(record.token_ids)
        first = gumbel_top(draft, seq, 2)
        second = gumbel_top(draft, [*seq, first[0]], 2)
        tree = DraftTree((*first, *second), (-1, -1, 0, 0))
        verdict = (await verifier.verify(VerifyBatch(items=(tree_item(record, tree),)))).results[0].verdict
        expected = []
        for _ in verdict.committed_token_ids:
            expected.append(gumbel_top(target, seq, 1)[0])
            seq.append(expected[-1])
        assert list(verdict.committed_token_ids) == expected
        record = await store.load(record.session_id)
    assert_cache_holds(verifier, record.session_id, record.token_ids)
    verifier.close()


def _pb_item(record, tokens, parents, probs=None) -> target_pb2.VerifyItem:
    proposal = common_pb2.Proposal(token_ids=tokens, parents=parents)
    if probs is not None:
        proposal.distributions.extend(draft_probs_to_pb(probs.float(), sparse=False))
    return target_pb2.VerifyItem(
        base=common_pb2.SessionBase(
            session_id=record.session_id, committed_len=record.committed_len, version=record.version
        ),
        proposal=proposal,
    )


@pytest.mark.parametrize(
    ("tokens", "parents", "says"),
    [
        ((1, 2, 3), (-1, 5, 0), "parent must be -1"),
        ((1, 2, 3), (-1, 0), "parents for 3 proposed tokens"),
        ((1, 1), (-1, -1), "distinct tokens"),
        (tuple(range(MAX_TREE_NODES + 1)), (-1,) * (MAX_TREE_NODES + 1), "at most 256"),
        ((1, 2, 3, 4, 5, 6, 7), (-1, 0, 1, 2, 3, 4, 5), "7 proposed tokens"),  # a chain past max_gamma
        ((1, 2, 3, 4, 5, 6, 7), (-1, -1, 1, 2, 3, 4, 5), "6 levels deep"),
        ((1, 400), (-1, -1), "out of range"),
    ],
)
async def test_a_malformed_tree_is_refused_alone_and_the_session_goes_on(
    target, store, tokens, parents, says
):
    """Bounds and shape checked from the wire, before any work: the item gets INVALID_ARGUMENT with what to fix,
    its batch-mate is verified, and the session's next round (a valid tree) commits."""
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, GREEDY)
    mate = await new_session(store, PROMPT[::-1], GREEDY)
    request = target_pb2.VerifyRequest(items=[_pb_item(record, tokens, parents), _pb_item(mate, (), ())])
    batch = batch_from_pb(request, vocab_size=target.vocab_size, max_gamma=5, max_batch_size=8)
    assert [i.session_id for i in batch.items] == [mate.session_id]
    ((index, refused),) = batch.refused
    assert index == 0 and isinstance(refused.error, InvalidArgument)
    assert says in refused.error.message
    results = (await verifier.verify(batch)).results
    assert results[0].error is refused.error and results[1].verdict is not None
    tree = greedy_tree(target, record.token_ids, 2, 2)
    request = target_pb2.VerifyRequest(items=[_pb_item(record, tree.tokens, tree.parents)])
    batch = batch_from_pb(request, vocab_size=target.vocab_size, max_gamma=5, max_batch_size=8)
    verdict = (await verifier.verify(batch)).results[0].verdict
    assert list(verdict.committed_token_ids) == greedy_continuation(target, record.token_ids, 3)
    verifier.close()


@pytest.mark.unit
def test_a_chain_sent_with_its_parents_is_a_chain():
    """Parents (-1, 0, 1, ...) are the chain's: the item takes the chain's path, no tree."""
    base = common_pb2.SessionBase(session_id="s", committed_len=3, version=1)
    pb = target_pb2.VerifyItem(
        base=base, proposal=common_pb2.Proposal(token_ids=(4, 5, 6), parents=(-1, 0, 1))
    )
    batch = batch_from_pb(target_pb2.VerifyRequest(items=[pb]), vocab_size=50, max_gamma=4, max_batch_size=2)
    assert batch.items[0].tree is None and batch.items[0].proposal.token_ids == (4, 5, 6)


async def test_min_new_tokens_masks_a_trees_rows_by_depth(target, store):
    """``min_new_tokens`` 3 with the target's own first two greedy tokens as stop tokens: every row of a two-level
    tree emits a token before the minimum, so the stop tokens are masked at the root and at each node whatever
    its place in the node order; the tree offers the unmasked argmax first at each level and the masked one
    second, and the verdict is masked greedy decoding (fresh prefills, the stop tokens set to -inf)."""
    stop_ids = tuple(greedy_continuation(target, PROMPT, 2))
    stop = StopConditions(max_new_tokens=16, min_new_tokens=3, stop_token_ids=stop_ids)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, GREEDY, stop=stop)

    def argmax(seq, masked):
        logits = fresh_logits(target, seq)[-1].clone()
        if masked:
            logits[list(stop_ids)] = float("-inf")
        return int(logits.argmax())

    seq, tokens, parents, parent = list(PROMPT), [], [], -1
    for _ in range(2):
        free, masked = argmax(seq, False), argmax(seq, True)
        offered = [free, masked] if free != masked else [masked]
        tokens += offered
        parents += [parent] * len(offered)
        parent = len(tokens) - 1
        seq.append(masked)
    assert tokens[0] == stop_ids[0], "the unmasked argmax at the root is a stop token: the mask matters"
    tree = DraftTree(tuple(tokens), tuple(parents))
    verdict = (await verifier.verify(VerifyBatch(items=(tree_item(record, tree),)))).results[0].verdict
    assert list(verdict.committed_token_ids) == [*seq[len(PROMPT) :], argmax(seq, True)]
    assert verdict.accepted_count == 2 and not verdict.finish_reason
    verifier.close()
