"""Linear layers with prepacked oneDNN weights: the workers' faster kernel path on a CPU.

On a CPU, PyTorch's stock ``F.linear`` runs a matrix-vector kernel for one
row and MKL's ``sgemm`` for two or more. The verify pass feeds ``gamma + 1``
positions, so it always takes the second, which on a CPU reads the weights
more slowly than the one-row kernel: most of why a verify pass over k positions
costs well over a decoding step. oneDNN's matmul with the weight reordered
once, at load time, into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout ``torch.compile``'s
CPU backend freezes weights into) is meant to read the weights at full speed
for any number of rows, and one row at no more than the stock kernel's cost
(``python -m benchmarks kernels`` measures both, per shape and for the
whole pass; the figures: docs/benchmarks/kernels.md and
docs/benchmarks/history.md).

Exactness. The kernel is a different order of float additions from the stock
one, so logits differ from the stock path's in the last bits (about 1e-4 on the
real target's logits), as the stock path's one-row and many-row kernels differ
from each other. What the verify rule needs is that a position's logits do not
depend on how many positions the pass holds: on the CPUs tested, the packed kernel
gives every row bitwise the same result whatever the number of rows (2-80) and
wherever the row sits, and for one row too, except where ``in_features`` is
above 1,024 (the MLP's down projection): there a lone row takes another kernel.
:func:`fewest_rows` finds this per weight shape, once, and a
:class:`PackedLinear` pads a lone row to the fewest rows that share the kernel
(2 costs no more than 1), so a one-position step and a pass over k positions
give a position the same bits; ``tests/specserve/engine/test_cpu_kernels.py`` checks
it on the machine that runs the tests. A benchmark run with ``--kernels onednn`` compares
greedy output token for token with the target alone using the same kernels,
and with the stock kernels.

:func:`use_packed_linears` swaps every ``nn.Linear`` of a model for a
:class:`PackedLinear` (after a check against ``F.linear`` on the model's own
weights); :func:`resolve` picks the path for a setting, a device and a dtype:
``"auto"`` is the packed path on a CPU in float32 where this PyTorch has the
oneDNN ops, the stock path otherwise (CUDA has its own kernels). The draft's
drafting passes take the same kernel, unpadded (or padded to 2) where
:func:`fewest_rows` allows it and in fixed-shape row blocks otherwise
(:class:`specserve.engine.row_invariant.PackedWeights`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Literal

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = structlog.get_logger(__name__)

#: The setting: "auto" (packed where it applies), "stock" (PyTorch's own kernels), "onednn" (packed, or fail),
#: "fastest" (where packing applies, both timed on the model as it loads and the faster kept:
#: :func:`use_faster_linears`; elsewhere stock).
Kernels = Literal["auto", "stock", "onednn", "fastest"]

#: The row count the weights are packed for. Any count is served; with 1 oneDNN picks a layout that makes
#: 2+ rows as slow as the stock kernel, with 2 or more one row stays as fast as the stock one (measured).
PACK_ROWS = 16


def onednn_available() -> bool:
    """This PyTorch build has the oneDNN linear ops (CPU builds with MKL-DNN)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def resolve(kernels: Kernels, device: torch.device, dtype: torch.dtype) -> Literal["stock", "onednn"]:
    """The kernel path a model on ``device`` in ``dtype`` gets for the setting ``kernels`` ("fastest": the
    path it may get, "onednn" where both are timed, :func:`use_faster_linears`)."""
    fits = device.type == "cpu" and dtype == torch.float32
    if kernels == "stock":
        return "stock"
    if kernels == "onednn":
        if not fits:
            raise ValueError(f"kernels='onednn' is for float32 models on a CPU, not {dtype} on {device}")
        if not onednn_available():
            raise ValueError("kernels='onednn' needs a PyTorch build with oneDNN (MKL-DNN); this one has none")
        return "onednn"
    return "onednn" if fits and onednn_available() else "stock"


def pack(weight: Tensor) -> Tensor:
    """``weight`` (``[out, in]``, float32, CPU) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` on ``packed`` (:func:`pack` of ``weight``): ``[..., in] -> [..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def fewest_rows(run: Callable[[Tensor], Tensor], in_features: int) -> int | None:
    """The fewest rows a call of ``run`` (a matmul ``[M, in] -> [M, out]``) must have for each row's bits
    not to depend on how many rows the call has or where the row sits: 1, 2 (one row alone takes another
    kernel: oneDNN does so for ``in`` above 1,024 here), or None (neither).

    Checked on random rows, computed all at once and in slices of other sizes and offsets (a lone row
    alone and padded to 2), bit for bit.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(35, in_features, generator=gen)  # [35, in]
    pad = torch.zeros(1, in_features)
    with torch.inference_mode():
        whole = run(x)  # [35, out]
        slices = ((0, 2), (3, 9), (5, 21), (1, 34))
        if not all(torch.equal(run(x[a:b]), whole[a:b]) for a, b in slices):
            return None
        if all(torch.equal(run(x[r : r + 1]), whole[r : r + 1]) for r in (0, 7, 34)):
            return 1
        if all(torch.equal(run(torch.cat([x[r : r + 1], pad]))[:1], whole[r : r + 1]) for r in (0, 7, 34)):
            return 2
    return None


#: (out, in, bias, threads) -> fewest_rows for that weight shape: the kernel oneDNN runs depends on the shape,
#: not the values, so each shape is checked once.
_FEWEST: dict[tuple[int, int, bool, int], int | None] = {}


def fewest_rows_of(packed: Tensor, shape: tuple[int, int], bias: Tensor | None) -> int | None:
    """:func:`fewest_rows` for the packed weight of ``shape`` (``[out, in]``), checked once per shape."""
    key = (shape[0], shape[1], bias is not None, torch.get_num_threads())
    if key not in _FEWEST:
        _FEWEST[key] = fewest_rows(lambda x: packed_linear(x, packed, bias), shape[1])
        if _FEWEST[key] is None:  # a row-invariant pass keeps fixed row blocks for this shape
            log.info("packed_weight_row_blocked", shape=shape)
        elif _FEWEST[key] != 1:
            log.debug("packed_linear_rows", shape=shape, fewest_rows=_FEWEST[key])
    return _FEWEST[key]


def pad_rows(x: Tensor, rows: int | None, matmul: Callable[[Tensor], Tensor]) -> Tensor:
    """``matmul`` of ``x`` ``[..., K]`` in one call of at least ``rows`` rows (zero rows added, dropped from
    the result; None or 1: ``x`` as it is) -> ``[..., N]``."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    m = flat.shape[0]
    if rows is None or m >= rows:
        return matmul(x)
    out = matmul(torch.cat([flat, flat.new_zeros(rows - m, flat.shape[1])]))[:m]  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """``F.linear`` with ``weight`` (``[out, in]``, float32, CPU) on oneDNN's blocked layout of it
    (inference only)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters or buffers: nothing here trains, moves or is saved.
        self.packed = pack(weight)
        self.bias = None if bias is None else bias.detach()
        #: A lone row is padded to this many (2 where one row alone takes another kernel), so that a
        #: position's logits are the same bits in a one-position step and in a verify pass over k;
        #: None: no row count gives row-independent bits (the call is made as it comes).
        self.fewest_rows = fewest_rows_of(self.packed, tuple(weight.shape), self.bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return pad_rows(x, self.fewest_rows, lambda rows: packed_linear(rows, self.packed, self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
    """The packed layer computes the stock one's function (to float rounding) on a few random rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, linear.in_features, generator=gen)  # [3, in]
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        got = packed(x)
    scale = want.abs().max().item() + 1.0
    return got.shape == want.shape and bool(((got - want).abs().max() <= 1e-4 * scale).item())


def _swaps(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, PackedLinear]]:
    """``(parent, name, stock layer, packed layer)`` for every ``nn.Linear`` of ``model``; raises
    ``RuntimeError`` when a packed layer does not compute what the stock one does."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                    raise ValueError("packed linears are for float32 weights on the CPU")
                packed = PackedLinear(child.weight, child.bias)
                if not _agrees(child, packed):
                    raise RuntimeError(f"oneDNN's packed linear disagrees with F.linear on {name!r}; keep kernels=stock")
                swaps.append((parent, name, child, packed))
    return swaps


def use_packed_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` (a float32 model on the CPU) by a :class:`PackedLinear`.

    Returns the number replaced. Raises ``RuntimeError`` (and changes nothing)
    when a packed layer does not compute what the stock one does.
    """
    swaps = _swaps(model)
    for parent, name, _, packed in swaps:
        setattr(parent, name, packed)
    log.debug("packed_linears", layers=len(swaps))
    return len(swaps)


def time_linears(
    model: nn.Module, timed_pass: Callable[[int], int], *, positions: tuple[int, ...] = (1, 5), repeats: int = 5
) -> tuple[Literal["stock", "onednn"], dict[str, float]]:
    """Time ``model`` (float32, CPU, stock linears) on both kernel paths; it is left on the stock path.

    ``timed_pass(k)`` runs one pass of the model over ``k`` new positions and returns its nanoseconds. Each
    path is timed at every ``k`` in ``positions`` (a decoding step and a verify pass), ``repeats`` times
    with the two paths alternating (a machine busy with something else slows both alike), after a round
    that warms both up; the path with the smaller sum of medians wins. Returns the winner and each path's
    sum in milliseconds. Which path is faster depends on the CPU (docs/benchmarks/kernels.md).
    """
    if path_of(model) == "onednn":
        raise ValueError("the model's linears are packed already; time the paths on a freshly loaded model")
    swaps = _swaps(model)
    if not swaps:
        return "stock", {}

    def take(path: str) -> None:
        for parent, name, stock, packed in swaps:
            setattr(parent, name, packed if path == "onednn" else stock)

    samples: dict[str, dict[int, list[int]]] = {p: {k: [] for k in positions} for p in ("stock", "onednn")}
    try:
        for rep in range(repeats + 1):  # the first round warms both paths up and is not kept
            for path in ("stock", "onednn") if rep % 2 else ("onednn", "stock"):
                take(path)
                for k in positions:
                    elapsed = timed_pass(k)
                    if rep:
                        samples[path][k].append(elapsed)
    finally:
        take("stock")
    totals = {p: sum(statistics.median(s) for s in by_k.values()) / 1e6 for p, by_k in samples.items()}
    return ("onednn" if totals["onednn"] < totals["stock"] else "stock"), totals


def use_faster_linears(
    model: nn.Module, timed_pass: Callable[[int], int], *, positions: tuple[int, ...] = (1, 5), repeats: int = 5
) -> tuple[Literal["stock", "onednn"], dict[str, float]]:
    """Leave ``model`` (float32, CPU) on whichever kernel path :func:`time_linears` finds faster in this
    process; returns the path and each path's time."""
    choice, totals = time_linears(model, timed_pass, positions=positions, repeats=repeats)
    if choice == "onednn":
        use_packed_linears(model)
    log.info("kernels_timed", choice=choice, positions=list(positions), **{f"{p}_ms": round(t, 2) for p, t in totals.items()})
    return choice, totals


def path_of(model: nn.Module) -> Literal["stock", "onednn"]:
    """The kernel path ``model`` runs on: "onednn" once :func:`use_packed_linears` swapped its layers."""
    return "onednn" if any(isinstance(m, PackedLinear) for m in model.modules()) else "stock"
