"""A draft tree in one padded pass (specserve.engine.batching, RowInput.tree): each node's logits and keys/values
are those of a chain pass over its path, on real tiny Llama and GPT-2 models (float32, within 1e-5), and the same
bits with invariant passes (specserve.engine.position_invariant), beside chain rows in the same batch."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from transformers import DynamicCache

from specserve.core.tree import DraftTree
from specserve.engine import batching, position_invariant
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit

ATOL = RTOL = 1e-5

#: Three children of the root, two levels below the first, one below the second: 7 nodes, 3 levels.
PARENTS = (-1, -1, 0, 0, 2, -1, 1)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def target(request, tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(
        tmp_path_factory.mktemp(f"tree_{request.param}"), arch=request.param
    )
    return load_model(target_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def invariant_target(tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("tree_invariant"), arch="llama")
    loaded = load_model(target_dir, device="cpu", dtype="float32", kernels="stock")
    position_invariant.prepare(loaded.model)
    return loaded


@torch.no_grad()
def _kv(model, tokens) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([list(tokens)]), cache=cache, use_cache=True)
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def _chain_row(model, past, feed):
    """One chain row's pass alone: ``(logits [len(feed), vocab], new kv)``."""
    row = batching.RowInput(
        past=_kv(model, past) if past else None, past_len=len(past), input_ids=tuple(feed)
    )
    packed = batching.pack([row], config=model.config, device="cpu")
    logits, grown = position_invariant.forward(model, packed)
    return batching.row_logits(logits, packed, 0), batching.new_kv(grown, packed, 0)


def _tree_batch(model, past, pending, tree, other):
    """A batch of a chain row ``other`` = (past, feed) and the tree row; returns the tree row's logits and KV."""
    rows = [
        batching.RowInput(past=_kv(model, other[0]), past_len=len(other[0]), input_ids=tuple(other[1])),
        batching.RowInput(
            past=_kv(model, past),
            past_len=len(past),
            input_ids=(*pending, *tree.tokens),
            logits_needed=tree.nodes + 1,
            tree=tree.parents,
        ),
    ]
    packed = batching.pack(rows, config=model.config, device="cpu")
    assert packed.positions_processed == len(other[1]) + len(pending) + tree.nodes
    logits, grown = position_invariant.forward(model, packed)
    return batching.row_logits(logits, packed, 1), batching.new_kv(grown, packed, 1)


def _check(model, compare):
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    seq = torch.randint(0, vocab, (20,), generator=gen).tolist()
    tokens = [
        int(t) for t in torch.randperm(vocab, generator=gen)[: len(PARENTS)]
    ]  # distinct: valid siblings
    tree = DraftTree(tuple(tokens), PARENTS)
    past, pending = seq[:11], seq[11:13]  # two inputs before the nodes: a catch-up token and the pending one
    other = (seq[:5], seq[5:9])
    logits, kv = _tree_batch(model, past, pending, tree, other)
    assert logits.shape[0] == tree.nodes + 1
    chain_logits, _ = _chain_row(model, past, pending)
    compare(logits[0], chain_logits[-1])  # the root's row: p after the pending token
    for node in range(tree.nodes):
        path = [tree.tokens[v] for v in tree.path(node)]
        chain_logits, chain_kv = _chain_row(model, past, [*pending, *path])
        compare(logits[node + 1], chain_logits[-1])
        for (k, v), (ck, cv) in zip(kv, chain_kv, strict=True):
            compare(k[0, :, len(pending) + node], ck[0, :, -1])
            compare(v[0, :, len(pending) + node], cv[0, :, -1])


def test_tree_nodes_equal_their_paths_as_chains(target):
    _check(target.model, lambda a, b: torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL))


def test_tree_nodes_are_their_paths_bits_with_invariant_passes(invariant_target):
    def same_bits(a, b):
        assert torch.equal(a, b), (a - b).abs().max()

    _check(invariant_target.model, same_bits)


def test_input_mask_is_causal_then_the_ancestor_mask():
    mask = batching.input_mask(2 + len(PARENTS), PARENTS)
    tree = DraftTree(tuple(range(len(PARENTS))), PARENTS)
    assert torch.equal(mask[2:, 2:], tree.ancestor_mask())
    assert mask[2:, :2].all() and torch.equal(mask[:2, :2], torch.ones(2, 2, dtype=torch.bool).tril())
    assert not mask[:2, 2:].any()
