"""specserve.engine.cpu_kernels: the target's packed oneDNN linears compute the stock function, row by row.

Real oneDNN kernels on this machine's CPU and real tiny transformers models.
Bitwise checks use ``torch.equal`` (no tolerance).
"""

from __future__ import annotations

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from torch import nn

from specserve.api.errors import FailedPrecondition
from specserve.engine import cpu_kernels
from specserve.engine.kvcache import SessionCache
from specserve.engine.models import load_model

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="this PyTorch has no oneDNN ops"),
    pytest.mark.unit,
]


def _packed(in_features: int, out_features: int, *, bias: bool, seed: int) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).eval()
    return linear, cpu_kernels.PackedLinear(linear.weight, linear.bias)


@pytest.mark.parametrize(
    ("k", "n", "bias"), [(64, 64, False), (576, 192, False), (96, 1536, True), (48, 8192, False), (1536, 576, False)]
)
def test_a_packed_linear_gives_each_row_the_same_bits_whatever_the_number_of_rows(k, n, bias):
    """What the verify pass relies on: position i's result does not depend on how many positions the pass
    holds or where the row sits (a lone row padded where one row alone takes another kernel, as oneDNN
    does for k > 1024 here); and the function is F.linear's up to float rounding."""
    linear, packed = _packed(k, n, bias=bias, seed=k + n)
    assert packed.fewest_rows in (1, 2)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(n))  # [M, K]
    with torch.inference_mode():
        alone = torch.cat([packed(x[r : r + 1]) for r in range(40)])  # [M, N], one row per call
        for rows in (2, 3, 5, 9, 16, 17, 40):
            for start in (0, 40 - rows):
                assert torch.equal(packed(x[start : start + rows]), alone[start : start + rows]), (rows, start)
        assert torch.equal(packed(x[:9].reshape(1, 9, k))[0], alone[:9])  # [batch, T, K] inputs too
        assert torch.equal(packed(x[4:5].reshape(1, 1, k))[0], alone[4:5])
        torch.testing.assert_close(alone, F.linear(x, linear.weight, linear.bias), rtol=1e-4, atol=1e-4)


def test_fewest_rows_tells_a_lone_row_kernel_and_a_row_mixing_one_apart():
    """The check finds 1 for a row-wise function, 2 where a lone row alone is computed otherwise (as the
    stock kernels do: a matrix-vector product for one row), and None where a row's result depends on the
    other rows of the call."""

    def rowwise(x):  # [M, 16] -> [M, 8], no reduction at all
        return x[:, :8] * 3.0

    def lone_row_other_kernel(x):
        return rowwise(x) + 1e-3 if x.shape[0] == 1 else rowwise(x)

    assert cpu_kernels.fewest_rows(rowwise, 16) == 1
    assert cpu_kernels.fewest_rows(lone_row_other_kernel, 16) == 2
    assert cpu_kernels.fewest_rows(lambda x: rowwise(x) + x.sum(0, keepdim=True)[:, :8], 16) is None
    x = torch.randn(1, 1, 16)
    padded = cpu_kernels.pad_rows(x, 2, lone_row_other_kernel)  # [1, 1, 8]
    assert padded.shape == (1, 1, 8) and torch.equal(padded, rowwise(x[0])[None])
    assert torch.equal(cpu_kernels.pad_rows(x, 1, lone_row_other_kernel), rowwise(x) + 1e-3)


def test_a_model_loaded_with_onednn_kernels_decodes_as_the_stock_model(tmp_path):
    """Every linear is swapped (the tied head too), the logits match the stock model's to float rounding,
    greedy decoding gives the same tokens, and a verify-shaped pass over 5 positions gives each position
    the logits that one-position steps give."""
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    stock = load_model(target_dir, device="cpu", dtype="float32", kernels="stock")
    fast = load_model(target_dir, device="cpu", dtype="float32", kernels="onednn")
    linears = sum(type(m) is nn.Linear for m in stock.model.modules())
    assert linears > 0
    assert sum(type(m) is cpu_kernels.PackedLinear for m in fast.model.modules()) == linears
    assert not any(type(m) is nn.Linear for m in fast.model.modules())
    assert fast.vocab_size == stock.vocab_size
    assert fast.parameter_count == stock.parameter_count

    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.inference_mode():
        torch.testing.assert_close(
            fast.model(input_ids=prompt).logits, stock.model(input_ids=prompt).logits, rtol=1e-4, atol=1e-4
        )
        want = stock.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
        got = fast.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    assert got.tolist() == want.tolist()

    stepped, passed = SessionCache(fast.model), SessionCache(fast.model)
    stepped.extend(prompt[0].tolist())
    passed.extend(prompt[0].tolist())
    feed = [9, 8, 7, 6, 5]
    steps = torch.cat([stepped.extend([t]) for t in feed])  # [5, vocab], one position per pass
    torch.testing.assert_close(passed.extend(feed), steps, rtol=1e-5, atol=1e-5)


def test_the_kernel_setting_resolves_by_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cpu_kernels.resolve("auto", cpu, torch.float32) == "onednn"
    assert cpu_kernels.resolve("auto", cpu, torch.bfloat16) == "stock"
    assert cpu_kernels.resolve("auto", cuda, torch.float32) == "stock"
    assert cpu_kernels.resolve("stock", cpu, torch.float32) == "stock"
    with pytest.raises(ValueError, match="float32 models on a CPU"):
        cpu_kernels.resolve("onednn", cuda, torch.bfloat16)


def test_asking_for_onednn_on_a_model_it_does_not_fit_is_a_clear_error(tmp_path):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    with pytest.raises(FailedPrecondition, match="kernels='onednn' is for float32 models on a CPU"):
        load_model(target_dir, device="cpu", dtype="bfloat16", kernels="onednn")


def test_fastest_keeps_the_path_whose_passes_time_faster_and_gives_the_stock_layers_back(tmp_path):
    """use_faster_linears times both paths at each pass size, alternating, and leaves the model on the one
    whose passes took less: where that is stock, the model's own nn.Linear objects are back in place."""
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    for faster, slower in (("onednn", "stock"), ("stock", "onednn")):
        model = load_model(target_dir, device="cpu", dtype="float32", kernels="stock").model
        originals = [m for m in model.modules() if type(m) is nn.Linear]
        calls: list[tuple[str, int]] = []

        def timed(k: int, faster=faster, model=model, calls=calls) -> int:
            path = cpu_kernels.path_of(model)
            calls.append((path, k))
            return (1_000 if path == faster else 1_500) * k

        choice, totals = cpu_kernels.use_faster_linears(model, timed, positions=(1, 5), repeats=3)
        assert choice == faster == cpu_kernels.path_of(model)
        assert totals[faster] == pytest.approx(6 * 1e-3) and totals[slower] == pytest.approx(9 * 1e-3)
        for path in ("stock", "onednn"):  # a warm-up round and 3 kept, at both sizes
            assert sorted(k for p, k in calls if p == path) == [1] * 4 + [5] * 4
        assert calls[0][0] != calls[4][0]  # the order alternates by round (2 sizes x 2 paths per round)
        if faster == "stock":
            assert [m for m in model.modules() if type(m) is nn.Linear] == originals  # the same objects
        else:
            with pytest.raises(ValueError, match="packed already"):  # it would compare onednn with itself
                cpu_kernels.use_faster_linears(model, timed)


def test_a_model_loaded_with_the_fastest_kernels_runs_one_path_and_decodes_as_the_stock_model(tmp_path):
    """kernels='fastest' (a target with invariance off) times the real passes as the model loads; whichever
    path wins, greedy decoding matches the stock model. Where packing does not apply it is stock, untimed."""
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    stock = load_model(target_dir, device="cpu", dtype="float32", kernels="stock")
    chosen = load_model(target_dir, device="cpu", dtype="float32", kernels="fastest")
    packed = sum(type(m) is cpu_kernels.PackedLinear for m in chosen.model.modules())
    plain = sum(type(m) is nn.Linear for m in chosen.model.modules())
    assert (packed, plain) in ((0, plain), (plain + packed, 0)) and packed + plain > 0  # all one path
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.inference_mode():
        want = stock.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
        got = chosen.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    assert got.tolist() == want.tolist()
    half = load_model(target_dir, device="cpu", dtype="bfloat16", kernels="fastest")
    assert cpu_kernels.path_of(half.model) == "stock"
