"""What ``pip install .`` installs: one top-level package, ``specserve``, with the benchmark a user runs
(``specserve bench``) and none of the one-off experiments, which stay in ``benchmarks/`` beside it.

The wheel is built for real (setuptools' PEP 517 backend, in a copy of the sources in a temporary folder,
no network) and its file list read.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Modules of ``benchmarks/`` whose names the package's benchmark shares on purpose (its entry point's parts).
SHARED_NAMES = {"__init__", "__main__", "cli", "options", "report"}


def experiment_modules() -> set[str]:
    """The one-off experiments' module names (``benchmarks/*.py``, the entry point's parts left out)."""
    names = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - SHARED_NAMES
    assert {"kernels", "invariance", "overhead", "structured", "prefix_cache", "bf16"} <= names
    return names


@pytest.mark.unit
def test_the_package_holds_no_experiment_and_finds_only_specserve():
    bench = {p.stem for p in (ROOT / "specserve" / "bench").glob("*.py")}
    assert {"gate", "harness", "latency", "draft_card", "head_card", "report"} <= bench
    assert bench & experiment_modules() == set()
    assert '[tool.setuptools.packages.find]\ninclude = ["specserve*"]\n' in (ROOT / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    """The files of the wheel built from a copy of the sources (the folders beside the package included, so
    that leaving them out is the build's doing)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for name in ("specserve", "benchmarks", "scripts"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("specserve-*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.mark.system
def test_the_wheel_has_one_top_level_package_and_no_experiment(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specserve"}
    bench = {Path(n).stem for n in wheel_files if n.startswith("specserve/bench/") and n.endswith(".py")}
    assert "gate" in bench and bench & experiment_modules() == set()
    for shipped in ("specserve/bench/gate.py", "specserve/bench/task_prompts.py", "specserve/prompts/chat.py"):
        assert shipped in wheel_files
