"""specserve.engine.row_invariant: a row's result does not depend on the other rows of its batch, bit for bit.

Real tiny Llama and GPT-2 models in float32 on CPU. The equality checks use
``torch.equal`` (no tolerance): a plain padded pass differs from the rows run
alone in the last bits, which these tests would catch.
"""

from __future__ import annotations

import pytest
import tiny_models
import torch
import torch.nn.functional as F

from specserve.engine import batching, cpu_kernels, row_invariant
from specserve.engine.kvcache import SessionCache
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit

ONEDNN = pytest.param(
    "onednn", marks=pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="no oneDNN ops in this PyTorch")
)


@pytest.fixture(scope="module", params=[("llama", "stock"), ("gpt2", "stock"), ("llama", "onednn")])
def model(request, tmp_path_factory):
    arch, kernels = request.param
    if kernels == "onednn" and not cpu_kernels.onednn_available():
        pytest.skip("no oneDNN ops in this PyTorch")
    _, draft_dir = tiny_models.make_tiny_pair(tmp_path_factory.mktemp(f"rowinv_{arch}"), arch=arch)
    loaded = load_model(draft_dir, device="cpu", dtype="float32")
    row_invariant.prepare(loaded.model, kernels=kernels)
    assert (row_invariant.blocked_matmuls(loaded.model).packed is not None) == (kernels == "onednn")
    return loaded


@pytest.mark.parametrize("kernels", ["stock", ONEDNN])
@pytest.mark.parametrize(("k", "n"), [(32, 64), (48, 384), (192, 512), (512, 192), (192, 8192), (1536, 96)])
def test_a_row_blocked_matmul_gives_a_row_the_same_bits_whatever_its_neighbours(k, n, kernels):
    """The kernel property the design rests on: a row's result depends on that row alone, not on the rows
    around it, their number or its place (stock kernels: every call a block of the same shape; oneDNN's on
    packed weights: rows unpadded, a lone row padded to 2 where it would take another kernel, as for
    k = 1536 here, or blocks where neither holds)."""
    gen = torch.Generator().manual_seed(k * n)
    weight = torch.randn(n, k, generator=gen)  # [N, K]
    x = torch.randn(40, k, generator=gen)  # [M, K]
    with row_invariant.RowBlockedMatmuls(row_invariant.PackedWeights() if kernels == "onednn" else None):
        reference = F.linear(x, weight)  # [M, N]
        for trial in range(6):
            order = torch.randperm(40, generator=gen)
            count = int(torch.randint(1, 41, (), generator=gen))
            picked = order[:count]
            out = F.linear(x[picked], weight)  # [count, N]
            assert torch.equal(out, reference[picked]), f"trial {trial}: {count} rows"
        alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(40)])  # [M, N]
    assert torch.equal(alone, reference)
    torch.testing.assert_close(reference, F.linear(x, weight), atol=1e-4, rtol=1e-5)  # the same matmul


def test_addmm_is_row_blocked_too():
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = (
        torch.randn(21, 48, generator=gen),
        torch.randn(48, 144, generator=gen),
        torch.randn(144),
    )
    with row_invariant.RowBlockedMatmuls():
        together = torch.addmm(bias, x, weight)  # [21, 144]
        alone = torch.cat([torch.addmm(bias, x[i : i + 1], weight) for i in range(21)])
    assert torch.equal(together, alone)


def _caches(model, prompts):
    return [SessionCache(model.model, f"s{i}") for i in range(len(prompts))]


def _step(model, caches, inputs):
    """One row-invariant pass over ``caches`` feeding ``inputs``; appends the KV, returns each row's last logits."""
    rows = [
        batching.RowInput(
            past=tuple(c.layer_kv()) or None, past_len=c.seq_len, input_ids=tuple(ids), logits_needed=1
        )
        for c, ids in zip(caches, inputs, strict=True)
    ]
    packed = batching.pack(rows, config=model.model.config, device="cpu")
    logits, grown = row_invariant.forward(model.model, packed)
    out = []
    for b, (c, ids) in enumerate(zip(caches, inputs, strict=True)):
        c.append_kv(batching.new_kv(grown, packed, b), ids)
        out.append(batching.row_logits(logits, packed, b)[-1].clone())  # [vocab]
    return out


def test_a_ragged_batch_equals_each_row_alone_bit_for_bit(model):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, model.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 1, 30, 9, 2)]
    alone_caches, batch_caches = _caches(model, prompts), _caches(model, prompts)
    inputs = [list(p) for p in prompts]
    for step in range(4):
        alone = [_step(model, [c], [ids])[0] for c, ids in zip(alone_caches, inputs, strict=True)]
        together = _step(model, batch_caches, inputs)
        for i, (a, t) in enumerate(zip(alone, together, strict=True)):
            assert torch.equal(a, t), f"step {step}, row {i}: max diff {(a - t).abs().max()}"
        inputs = [[int(a.argmax())] for a in alone]


def test_without_a_layout_a_prepared_model_is_plain_sdpa(model, tmp_path_factory):
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    plain = load_model(model.model.name_or_path, device="cpu", dtype="float32").model
    plain.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert torch.equal(model.model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_row_invariant_pass_needs_a_prepared_model(model):
    plain = load_model(model.model.name_or_path, device="cpu", dtype="float32").model
    row = batching.RowInput(past=None, past_len=0, input_ids=(1, 2))
    packed = batching.pack([row], config=plain.config, device="cpu")
    with pytest.raises(RuntimeError, match="prepare"):
        row_invariant.forward(plain, packed)
