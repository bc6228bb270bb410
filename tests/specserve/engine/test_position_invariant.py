"""specserve.engine.position_invariant: a position's logits are the same bits however the target computes
them.

A tiny real Llama with the default target's attention shapes (9 query heads
over 3 key/value heads of 64 dimensions, grouped attention) in float32 on the
CPU, prepared as a target replica prepares its model. The property test draws
a sequence up to the model's context, a position in it, and compares with
``torch.equal`` the position's logits from a one-position decoding step
against: a verify pass of width 1..16 over it, a prefill of the whole sequence
in random pieces, a batched pass beside random batch-mates (other lengths, so
padding), and a second replica loaded from the same files. The stock passes
fail the same comparison (the check can fail), and the invariant passes compute
what the stock ones do up to float rounding (invariance is not bought with a
wrong answer).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specserve.engine import batching, cpu_kernels, position_invariant
from specserve.engine.models import load_model
from specserve.runtime.config import TargetSettings

pytestmark = pytest.mark.unit

VOCAB = 384
CONTEXT = 160  # the tiny model's max_position_embeddings: prefills up to it, keys in 3 chunks of 64
WIDEST = 16  # verify passes over 1..16 positions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with SmolLM2-135M's attention shapes: hidden 576 = 9 heads x 64, 3 key/value heads."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=CONTEXT,
        initializer_range=0.05,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("invariant") / "target"
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    import tiny_models

    tiny_models.make_tiny_tokenizer(out, VOCAB)
    return out


def _load(model_dir, kernels: str, *, prepared: bool = True):
    model = load_model(model_dir, device="cpu", dtype="float32", kernels=kernels).model
    if prepared:
        position_invariant.prepare(model)
    return model


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two replicas of the target on the default kernel path ("auto"), each loaded and prepared alone."""
    return _load(model_dir, "auto"), _load(model_dir, "auto")


def _cache(model, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if tokens:
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return cache


def _pass(model, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:
    """Logits of a pass over ``tokens`` after ``cache``: ``[len(tokens), vocab]``."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]


def _step(model, tokens: list[int], p: int) -> torch.Tensor:
    """Position ``p``'s logits from a one-position decoding step after ``tokens[:p]``: ``[vocab]``."""
    return _pass(model, _cache(model, tokens[:p]), tokens[p : p + 1])[0]


def _batched(model, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """One padded pass over ``(past, inputs)`` rows (pasts prefilled alone): each row's ``[len(inputs), vocab]``."""
    inputs = []
    for past, feed in rows:
        cache = _cache(model, past)
        kv = tuple((layer.keys, layer.values) for layer in cache.layers) if past else None
        inputs.append(batching.RowInput(past=kv, past_len=len(past), input_ids=tuple(feed)))
    packed = batching.pack(inputs, config=model.config, device="cpu")
    logits, _ = position_invariant.forward(model, packed)
    return [batching.row_logits(logits, packed, b) for b in range(len(rows))]


tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=CONTEXT)


@st.composite
def cases(draw):
    """A sequence, a position in it, a verify pass over it, prefill cuts and batch-mates."""
    tokens = draw(tokens_st)
    n = len(tokens)
    p = draw(st.integers(0, n - 1))
    width = draw(st.integers(1, min(WIDEST, n)))
    start = draw(st.integers(max(0, p - width + 1), min(p, n - width)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    mates = draw(
        st.lists(
            st.tuples(st.integers(0, CONTEXT - WIDEST), st.integers(1, WIDEST)).flatmap(
                lambda s: st.tuples(
                    st.lists(st.integers(0, VOCAB - 1), min_size=s[0], max_size=s[0]),
                    st.lists(st.integers(0, VOCAB - 1), min_size=s[1], max_size=s[1]),
                )
            ),
            max_size=3,
        )
    )
    slot = draw(st.integers(0, len(mates)))
    return tokens, p, width, start, cuts, mates, slot


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_a_positions_logits_are_the_same_bits_however_it_is_computed(replicas, case):
    model, replica = replicas
    tokens, p, width, start, cuts, mates, slot = case
    want = _step(model, tokens, p)  # [vocab]: the one-position decoding step

    # A verify pass over tokens[start : start + width], the position among them.
    got = _pass(model, _cache(model, tokens[:start]), tokens[start : start + width])[p - start]
    assert torch.equal(got, want), ("verify pass", width, p - start)

    # A prefill of the whole sequence, in pieces cut at ``cuts`` (none: in one pass).
    cache = _cache(model, [])
    bounds = [0, *cuts, len(tokens)]
    for a, b in itertools.pairwise(bounds):
        logits = _pass(model, cache, tokens[a:b])
        if a <= p < b:
            assert torch.equal(logits[p - a], want), ("prefill", cuts)

    # A batched pass with batch-mates of other lengths (padding before and after the row's keys and queries).
    rows = [*mates[:slot], (tokens[:start], tokens[start : start + width]), *mates[slot:]]
    assert torch.equal(_batched(model, rows)[slot][p - start], want), ("batched", len(mates), slot)

    # Another replica, loaded and prepared on its own.
    assert torch.equal(_step(replica, tokens, p), want), "replica"


@pytest.mark.parametrize("kernels", ["stock", "onednn"])
def test_each_kernel_path_is_invariant_across_pass_widths(model_dir, kernels):
    """Both settings of the deployment's kernel path: a verify pass of every width 1..16 ending at each of a
    few positions gives the decoding step's bits (16-row blocks on the stock kernel, unpadded packed rows)."""
    if kernels == "onednn" and not cpu_kernels.onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    model = _load(model_dir, kernels)
    tokens = torch.randint(0, VOCAB, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
    for p in (0, 63, 64, 100, CONTEXT - 1):
        want = _step(model, tokens, p)
        for width in range(1, WIDEST + 1):
            start = max(0, p - width + 1)
            got = _pass(model, _cache(model, tokens[:start]), tokens[start : start + width])
            assert torch.equal(got[p - start], want), (p, width)


def test_the_stock_passes_fail_the_same_check(model_dir):
    """Without prepare() a position's logits move with the pass width: the checks above can fail."""
    model = _load(model_dir, "stock", prepared=False)
    tokens = torch.randint(0, VOCAB, (CONTEXT,), generator=torch.Generator().manual_seed(2)).tolist()
    p = 100
    want = _step(model, tokens, p)
    widths = [
        w
        for w in range(1, WIDEST + 1)
        if not torch.equal(_pass(model, _cache(model, tokens[: p - w + 1]), tokens[p - w + 1 : p + 1])[-1], want)
    ]
    assert widths, "the stock passes gave every width the decoding step's bits"


def test_invariant_passes_compute_what_the_stock_ones_do(model_dir):
    stock = _load(model_dir, "stock", prepared=False)
    model = _load(model_dir, "stock")
    tokens = torch.randint(0, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = stock(input_ids=tokens).logits
        got = model(input_ids=tokens).logits
    assert not torch.equal(got, want)  # another order of additions...
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # ...of the same sums


@pytest.mark.parametrize("head_dim", [12, 64, 128])
def test_the_attention_products_give_a_row_the_same_bits_from_the_fewest_rows_on(head_dim):
    """The kernel property the attention relies on, on this machine: a [m, K] x [K, N] float32 product (K the
    head dim for the scores, the 64-key chunk for the values) gives a row the same bits for every row count
    m >= MIN_QUERY_ROWS, wherever the row sits and whatever N (prepare() checks it too)."""
    gen = torch.Generator().manual_seed(0)
    for k_dim in (head_dim, position_invariant.KEY_CHUNK):
        a = torch.randn(3, 700, k_dim, generator=gen)  # [KV, rows, K]
        b = torch.randn(3, k_dim, 5 * position_invariant.KEY_CHUNK, generator=gen)  # [KV, K, N]
        whole = torch.matmul(a, b)
        for m in (position_invariant.MIN_QUERY_ROWS, 5, 7, 16, 33, 300):
            for at in (0, 11, 700 - m):
                assert torch.equal(torch.matmul(a[:, at : at + m], b), whole[:, at : at + m]), (k_dim, m, at)
        assert torch.equal(torch.matmul(a[:, :8], b[:, :, :64]), whole[:, :8, :64]), k_dim
    assert position_invariant.products_row_invariant(head_dim)


def test_packed_blocks_go_unpadded_only_where_the_kernel_allows(model_dir):
    if not cpu_kernels.onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    model = _load(model_dir, "onednn")
    layers = [m for m in model.modules() if isinstance(m, position_invariant.InvariantLinear)]
    assert layers and all(m.kernels == "onednn" for m in layers)
    assert all(m.fewest_rows in (1, 2, None) for m in layers)
    # fewest_block_rows refuses a matmul whose row bits depend on the row count.
    assert position_invariant.fewest_block_rows(lambda x: x * x.shape[0], 8) is None


def test_prepare_swaps_every_linear_and_the_attention(model_dir):
    model = _load(model_dir, "stock")
    assert position_invariant.is_invariant(model)
    wrapped = {id(m.layer) for m in model.modules() if isinstance(m, position_invariant.InvariantLinear)}
    assert wrapped and all(id(m) in wrapped for m in model.modules() if type(m) is torch.nn.Linear)
    assert position_invariant.prepare(model) == 0  # a second call changes nothing
    stock = _load(model_dir, "stock", prepared=False)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in stock.parameters())


def test_the_target_settings_refuse_a_kernel_path_timed_per_process_with_invariance():
    settings = TargetSettings(host="127.0.0.1")
    assert not settings.invariant and settings.kernels == "auto"  # invariance is opt-in
    with pytest.raises(ValueError, match="fastest"):
        TargetSettings(host="127.0.0.1", kernels="fastest", invariant=True)
    assert TargetSettings(host="127.0.0.1", kernels="fastest").kernels == "fastest"


def test_with_invariance_off_a_positions_logits_agree_only_to_rounding_as_the_readme_says(model_dir):
    """The faster path (``--no-invariant``: transformers' attention, the packed kernels' own row handling) keeps
    the promise README makes for it: across pass widths a position's logits agree to float rounding (here
    within 1e-5 of their scale), not bit for bit."""
    from pathlib import Path

    readme = " ".join((Path(__file__).parents[3] / "README.md").read_text().split())
    assert (
        "by default they agree only to float rounding (about 1e-6 of their scale), and where the two largest "
        "logits lie within that rounding the token may differ from the target alone's" in readme
    )
    model = _load(model_dir, "auto", prepared=False)
    tokens = torch.randint(0, VOCAB, (CONTEXT,), generator=torch.Generator().manual_seed(4)).tolist()
    differ = 0
    for p in (20, 64, 130):
        want = _step(model, tokens, p)
        scale = want.abs().max()
        for width in range(2, WIDEST + 1):
            got = _pass(model, _cache(model, tokens[: p - width + 1]), tokens[p - width + 1 : p + 1])[-1]
            assert (got - want).abs().max() <= 1e-5 * scale, (p, width)
            differ += not torch.equal(got, want)
    assert differ, "the faster path gave every width the same bits: README undersells it"
