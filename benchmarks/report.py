"""``python -m benchmarks report FOLDER``: every experiment's report in FOLDER rendered again from its JSON,
then ``specserve bench report FOLDER`` (whose README links them), measuring nothing.

Rendered where their JSON is there: ``draft_scaling.md`` (with its plot), ``prediction.md``,
``sampling_modes.md``, ``overhead.md``, ``structured.md``, ``attention.md``, ``constraint_engines.md`` and
``coupled_lists.md``. The
other experiments' reports carry prose written around their figures (kernels.md, invariance.md,
prefix-cache.md): the run that measures them writes their tables.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specserve.bench import markdown as md
from specserve.bench import report as product_report
from specserve.bench.options import ReportOptions


def _draft_scaling(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks.draft_scaling import write_draft_scaling

    return write_draft_scaling(data, folder)


def _prediction(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks.prediction import write_prediction

    return write_prediction(data, folder)


def _sampling_modes(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks import sampling_modes

    return sampling_modes.write(data, folder)


def _overhead(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks import overhead

    return overhead.write(data, folder)


def _structured(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks import structured

    return md.write(folder, "structured", structured.render(data))


def _attention(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks import attention

    return md.write(folder, "attention", attention.render(data))


def _constraint_engines(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks import constraints

    return md.write(folder, "constraint_engines", constraints.render(data))


def _coupled_lists(data: dict[str, Any], folder: Path) -> Path:
    from benchmarks import coupled_lists

    return coupled_lists.write(data, folder)


#: Each report rendered again: its JSON's name (without ``.json``) and what writes its Markdown from it.
RENDERERS: dict[str, Callable[[dict[str, Any], Path], Path]] = {
    "draft_scaling": _draft_scaling,
    "prediction": _prediction,
    "sampling_modes": _sampling_modes,
    "overhead": _overhead,
    "structured": _structured,
    "attention": _attention,
    "constraint_engines": _constraint_engines,
    "coupled_lists": _coupled_lists,
}


def main(opts: ReportOptions) -> int:
    folder = opts.folder
    for name, render in RENDERERS.items():
        if (folder / f"{name}.json").exists():
            render(json.loads((folder / f"{name}.json").read_text()), folder)
    return product_report.main(opts)
