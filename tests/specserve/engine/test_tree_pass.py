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


def _own_tree_setup(model, seed: int, *, track: bool):
    """A session cache holding 11 random tokens (tracking features or not), the random sequence (16 tokens) they
    start, the two pending tokens after them, and a tree of distinct tokens on :data:`PARENTS`."""
    from specserve.engine.kvcache import SessionCache

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seq = torch.randint(0, vocab, (16,), generator=gen).tolist()
    tree = DraftTree(tuple(int(t) for t in torch.randperm(vocab, generator=gen)[: len(PARENTS)]), PARENTS)
    cache = SessionCache(model, "s")
    if track:
        cache.track_features()
    cache.extend(seq[:11])
    return cache, seq, seq[11:13], tree


def test_a_session_caches_own_tree_pass_is_the_padded_pass(target):
    """``SessionCache.extend_tree`` (a lone session's tree, in its own cache): the logits of the pending token
    and every node, and each node's keys/values, are those of the padded pass (within float rounding); the
    cache then holds the past and the pending tokens only, and a chain fed after it continues from there."""
    model = target.model
    cache, seq, pending, tree = _own_tree_setup(model, 5, track=False)
    past = seq[:11]
    logits, tree_kv, features = cache.extend_tree(
        [*pending, *tree.tokens], tree.parents, logits_to_keep=tree.nodes + 1
    )
    assert features is None  # the cache does not track features
    other = (seq[:5], seq[5:9])
    want_logits, want_kv = _tree_batch(model, past, pending, tree, other)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=RTOL)
    for (k, v), (wk, wv) in zip(tree_kv, want_kv, strict=True):
        assert k.shape[2] == tree.nodes
        torch.testing.assert_close(k, wk[:, :, len(pending):], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v, wv[:, :, len(pending):], atol=ATOL, rtol=RTOL)
    assert list(cache.tokens) == [*past, *pending] and cache.seq_len == len(past) + len(pending)
    nxt = cache.extend(seq[13:16])
    chain_logits, _ = _chain_row(model, past, [*pending, *seq[13:16]])
    torch.testing.assert_close(nxt, chain_logits[-3:], atol=ATOL, rtol=RTOL)


def test_a_tree_pass_in_the_session_cache_refuses_a_bad_shape(target):
    from specserve.api.errors import InvalidArgument
    from specserve.engine.kvcache import SessionCache

    cache = SessionCache(target.model, "s")
    cache.extend([1, 2, 3])
    with pytest.raises(InvalidArgument, match="tree nodes"):
        cache.extend_tree([4, 5], (-1, 0, 1), logits_to_keep=2)
    assert list(cache.tokens) == [1, 2, 3]


def test_a_tracking_caches_tree_pass_returns_each_nodes_feature_and_keeps_the_chains(target):
    """With features tracked, each node's returned feature is the one its path fed as a chain would give, and
    the cache keeps the features of the tokens before the tree only."""
    from specserve.engine.kvcache import SessionCache

    model = target.model
    cache, seq, pending, tree = _own_tree_setup(model, 6, track=True)
    past = seq[:11]
    _, _, features = cache.extend_tree([*pending, *tree.tokens], tree.parents, logits_to_keep=tree.nodes + 1)
    assert features is not None and features.shape[0] == tree.nodes
    assert cache.features_len == len(past) + len(pending)
    for node in range(tree.nodes):
        chain = SessionCache(model, "c")
        chain.track_features()
        path = [*past, *pending, *(tree.tokens[v] for v in tree.path(node))]
        chain.extend(path)
        torch.testing.assert_close(features[node], chain.feature_rows(len(path) - 1, len(path))[0].float(),
                                   atol=2e-3, rtol=2e-3)  # the chain's kept rows are float16
