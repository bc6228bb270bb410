"""The documentation against the repository: every link resolves, every path README and docs/internals.md
name exists, README stays short and runs CI's own test command, and docs/internals.md stays a map: the layout
and one round's walk, under 300 lines.

``tests/test_architecture.py`` checks the backquoted file names of docs/internals.md and the order of its
walk; this module reads every path under a top-level folder, quoted or not, and the ``python -m`` modules.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INTERNALS = ROOT / "docs" / "internals.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]

#: The repository's top-level folders a document may name a path under.
TOP = "specserve protos deploy tests scripts docs models benchmarks .ci".split()
#: A path under one of them (``specserve/coordinator/round.py``, ``specserve/v1/``, ``models/specserve-demo-*``), not
#: the tail of a longer path or a URL.
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, TOP)) + r")/(?:[\w.*-]+/)*[\w.*-]*)")
#: A module run with ``python -m`` from one of the packages, or the experiments' entry point.
MODULE = re.compile(r"python3?\s+-m\s+(specserve(?:\.\w+)+|benchmarks)\b")
#: A benchmark's command line: ``specserve bench NAME`` (the package's) or ``python -m benchmarks NAME`` (a checkout's).
BENCH_COMMAND = re.compile(r"(specserve\s+bench|python3?\s+-m\s+(?:specserve\.bench|benchmarks))\s+([a-z][\w-]*)")
#: The model cards, which quote the commands their figures come from.
CARDS = [*sorted(ROOT.glob("models/*/README.md")), *sorted(ROOT.glob("specserve/models/*/README.md"))]
#: A Markdown link's target.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def named_paths(text: str) -> set[str]:
    return {p.rstrip(".") for p in PATH.findall(text)}


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def module_exists(module: str) -> bool:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__main__.py").exists()


def bench_commands(text: str) -> list[tuple[str, str]]:
    """Each benchmark command quoted in ``text``: (its entry point, the subcommand it names)."""
    return [(" ".join(entry.split()), name) for entry, name in BENCH_COMMAND.findall(text)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.unit
def test_the_path_pattern_reads_paths_and_nothing_else():
    text = "`specserve/coordinator/round.py`, specserve/v1/ and models/specserve-demo-*; not a/coordinator/x.py or http://h/docs/x"
    assert named_paths(text) == {"specserve/coordinator/round.py", "specserve/v1/", "models/specserve-demo-*"}
    assert not exists("specserve/coordinator/no_such_module.py") and exists("models/specserve-demo-*")


@pytest.mark.unit
def test_the_command_pattern_reads_both_entry_points():
    text = "`specserve bench gate`, `python -m\n  benchmarks kernels --out x`, python3 -m specserve.bench load, specserve benchmark"
    assert bench_commands(text) == [
        ("specserve bench", "gate"), ("python -m benchmarks", "kernels"), ("python3 -m specserve.bench", "load")
    ]


def commands_that_do_not_exist(doc: Path) -> list[str]:
    """The benchmark commands and ``python -m`` modules ``doc`` quotes that name nothing: ``specserve bench X``
    must name one of the package's benchmarks, ``python -m benchmarks X`` one of the experiments."""
    from benchmarks import cli as experiments
    from specserve.bench import cli as bench

    product = {n for c in bench.SUBCOMMANDS for n in (c.name, *c.aliases)}
    text = doc.read_text()
    missing = [
        f"{entry} {name}"
        for entry, name in bench_commands(text)
        if name not in (set(experiments.names()) if entry.endswith("benchmarks") else product)
    ]
    return missing + [m for m in MODULE.findall(text) if not module_exists(m)]


@pytest.mark.unit
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_benchmark_command_names_a_subcommand_that_exists(doc: Path):
    """The reports in docs/benchmarks regenerate from the commands the docs quote."""
    assert commands_that_do_not_exist(doc) == []


@pytest.mark.system  # a model's directory is a real model's (tests/tiers.py)
@pytest.mark.parametrize("card", CARDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_model_card_quotes_exists(card: Path):
    assert len(CARDS) >= 4
    assert commands_that_do_not_exist(card) == []


@pytest.mark.unit
def test_internals_names_only_paths_and_modules_that_exist():
    text = INTERNALS.read_text()
    named = named_paths(text)
    assert len(named) > 50
    assert sorted(p for p in named if not exists(p)) == []
    modules = MODULE.findall(text)
    assert modules and [m for m in modules if not module_exists(m)] == []


@pytest.mark.unit
def test_internals_is_the_layout_and_one_walk():
    """docs/internals.md is the layout and one round's walk (issue 55: under half its 679 lines); the round is
    narrated in full once, in docs/design.md, "One round, step by step", which the walk points to."""
    text = INTERNALS.read_text()
    assert len(text.splitlines()) < 300
    headings = re.findall(r"^## (.*)$", text, flags=re.M)
    assert headings == [
        "Layers", "Layout", "One round, file by file", "Installing, and regenerating what is generated"
    ]
    assert "One round, step by step" in text
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## One round, step by step" in design


@pytest.mark.unit
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc: Path):
    """Every relative Markdown link of README and docs/ names a file that exists, and a heading of it."""
    text = doc.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        path, _, fragment = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            broken.append(target)
        elif fragment and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            if fragment not in {anchor(h) for h in headings}:
                broken.append(target)
    assert broken == []


@pytest.mark.unit
def test_readme_names_only_paths_that_exist():
    named = named_paths(README.read_text())
    assert len(named) > 10
    assert sorted(p for p in named if not exists(p)) == []


@pytest.mark.unit
def test_readme_is_read_in_two_minutes():
    assert len(README.read_text().splitlines()) <= 150


def ci_test_command() -> str:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    (command,) = [line for line in lines if line.startswith("python3 -m pytest")]
    return command


@pytest.mark.unit
def test_readme_runs_the_tests_as_ci_does():
    """README's test command ends with exactly the command ``.ci/run`` runs, and the unit tier is that
    command with ``-m unit``."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    commands = [line for block in blocks for line in block.splitlines()]
    install_and_test = [c for c in commands if "pytest" in c]
    assert len(install_and_test) == 1
    ci = ci_test_command()
    assert install_and_test[0].split(" && ")[-1] == ci
    assert shlex.split(ci)[:3] == ["python3", "-m", "pytest"]
    assert f"`{ci} -m unit`" in README.read_text()
