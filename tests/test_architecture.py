"""The shape of the code base (docs/design.md, "Layers"), read from the source with ``ast``.

* The import graph of the packages has no cycle (imports inside functions count;
  ``if TYPE_CHECKING:`` blocks do not, they never run).
* ``specserve/`` is split by audience into floors, and each module imports only
  its own floor and the floors below it (:data:`MAY_IMPORT`): ``api`` (with the
  stubs, ``v1``), then ``core``, ``engine``, ``runtime``. The SDK (``client``)
  and ``api`` import only ``api``, ``v1``, grpc, protobuf and the standard
  library: no torch, transformers or numpy, by layout. Their ``__init__.py``
  files hold a docstring only (the SDK's re-exports its names).
* The roles (``specserve.coordinator``, ``specserve.draft``, ``specserve.target``) import only
  ``api``, ``v1``, ``core``, ``engine`` and ``runtime``; no role imports another;
  only the launcher (``specserve/launch/``) and the benchmark
  (``specserve/bench/``) import a role.
* Nothing in ``specserve`` imports the one-off experiments (``benchmarks/``, not installed) or ``scripts/``.
* ``specserve/coordinator/round.py`` uses no attribute of the pool but its public methods, and its
  ``RoundLoop.step`` (plan, propose, verify, learn, apply) is at most 10 lines.
* Inside the roles only the edges import the wire (``specserve.v1``): the fleet's client module, the
  servicers and servers, the worker roles' message modules, and the coordinator's front end
  (:data:`WIRE_EDGES`). Nothing under ``specserve/coordinator/speculation/`` imports the fleet.
* ``Coordinator.generate`` and ``verify_batch`` stay under 50 lines.
* ``docs/internals.md`` names only files that exist, and walks one round through at most 6 of them.
* Nothing in the repository points at design notes outside it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specserve",)  # one top-level package: the roles live under it
ROLES = ("specserve.coordinator", "specserve.draft", "specserve.target")
#: The only parts of specserve that import roles: the composition roots.
ABOVE_ROLES = ("specserve.launch", "specserve.bench")
#: What the roles build on.
FLOORS = ("specserve.api", "specserve.v1", "specserve.core", "specserve.engine", "specserve.runtime")
#: Each part (a subpackage of specserve, or a role) and the parts it may import besides itself.
#: Parts not listed (the launcher, the benchmark, the ``specserve`` root) sit above everything.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "specserve.v1": (),
    "specserve.api": ("specserve.v1",),
    "specserve.client": ("specserve.api", "specserve.v1"),
    "specserve.core": ("specserve.api", "specserve.v1"),
    "specserve.engine": ("specserve.api", "specserve.v1", "specserve.core"),
    "specserve.runtime": ("specserve.api", "specserve.v1", "specserve.core", "specserve.engine"),
    "specserve.prompts": (),  # data: the prompt lists the training scripts and the benchmark share
    **{role: FLOORS for role in ROLES},
}
#: The SDK's parts, and the only third-party packages they may import (with the standard library).
SDK = ("specserve.client", "specserve.api", "specserve.v1")
SDK_THIRD_PARTY = ("grpc", "google.protobuf")


def _modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str) -> set[str]:
    """Dotted names ``module`` imports anywhere (functions included), ``if TYPE_CHECKING:`` blocks excluded."""
    names: set[str] = set()
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # a submodule, or a name defined in ``base``
                full = f"{base}.{alias.name}"
                names.add(full if full in MODULES else base)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _edges(module: str) -> set[str]:
    """The modules of the packages that ``module`` imports."""
    out: set[str] = set()
    for name in _imported_names(ast.parse(MODULES[module].read_text()), module):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


GRAPH = {module: _edges(module) for module in MODULES}


def _package(module: str) -> str:
    return module.partition(".")[0]


def _within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def _role(module: str) -> str | None:
    """The role ``module`` belongs to (None: not a role's)."""
    return next((role for role in ROLES if _within(module, role)), None)


def _part(module: str) -> str | None:
    """The entry of :data:`MAY_IMPORT` that ``module`` belongs to (None: above every rule)."""
    return next((part for part in MAY_IMPORT if _within(module, part)), None)


def _third_party(module: str) -> set[str]:
    """What ``module`` imports from outside the packages and the standard library."""
    names = _imported_names(ast.parse(MODULES[module].read_text()), module)
    return {
        name
        for name in names
        if _package(name) not in PACKAGES and _package(name) not in sys.stdlib_module_names
    }


@pytest.mark.unit
def test_the_graph_is_read_from_real_imports():
    """Guards the tests below: known edges are found (so an empty graph cannot pass them)."""
    assert "specserve.coordinator.fleet.pool" in GRAPH["specserve.coordinator.round"]
    assert "specserve.api.status" in GRAPH["specserve.client._client"]
    assert "specserve.bench.cli" in GRAPH["specserve.launch.cli"]  # a lazy import inside a function
    assert "specserve.api" not in GRAPH["specserve.client._client"]  # "from specserve.api import errors" is specserve.api.errors
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import specserve.coordinator.fleet.pool\n")
    assert "specserve.coordinator.fleet.pool" not in _imported_names(hidden, "specserve.launch.cli")
    assert len(GRAPH) > 60
    assert "torch" in _third_party("specserve.core.sampling")
    assert "grpc" in _third_party("specserve.client._client")
    assert _part("specserve.engine.models") == "specserve.engine" and _part("specserve.launch.cli") is None
    assert {_part(m) for m in MODULES} >= set(MAY_IMPORT)  # every part has modules
    assert _role("specserve.draft.engine") == "specserve.draft" and _role("specserve.core.rng") is None


@pytest.mark.unit
def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(GRAPH[module]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.unit
def test_only_the_launcher_and_the_benchmark_import_a_role():
    offenders = {
        module: sorted(m for m in GRAPH[module] if _role(m) is not None)
        for module in GRAPH
        if _role(module) is None and not any(_within(module, p) for p in ABOVE_ROLES)
    }
    assert {m: found for m, found in offenders.items() if found} == {}


@pytest.mark.unit
def test_each_floor_and_role_imports_only_itself_and_what_it_builds_on():
    """specserve's floors import only the floors below; roles only the floors (never launch, bench, client)."""
    offenders = {}
    for module, imported in GRAPH.items():
        part = _part(module)
        if part is None:
            continue
        allowed = (part, *MAY_IMPORT[part])
        found = sorted(m for m in imported if not any(_within(m, a) for a in allowed))
        if found:
            offenders[module] = found
    assert offenders == {}


@pytest.mark.unit
def test_the_sdk_and_api_import_no_torch_by_layout():
    """Every module of the SDK, api and the stubs: grpc, protobuf and the standard library only."""
    modules = [m for m in MODULES if any(_within(m, p) for p in SDK)]
    assert "specserve.client._client" in modules and "specserve.api.params" in modules
    offenders = {
        module: sorted(n for n in _third_party(module) if not any(_within(n, p) for p in SDK_THIRD_PARTY))
        for module in modules
    }
    assert {m: found for m, found in offenders.items() if found} == {}


@pytest.mark.unit
@pytest.mark.parametrize("part", ["api", "core", "engine", "runtime", "launch", "bench", "prompts"])
def test_subpackage_inits_hold_a_docstring_only(part):
    """Importing ``specserve.core`` (say) runs nothing, so it never pulls in torch by itself."""
    tree = ast.parse((ROOT / "specserve" / part / "__init__.py").read_text())
    assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in tree.body)


@pytest.mark.unit
def test_nothing_installed_imports_what_is_not():
    """``benchmarks/`` and ``scripts/`` sit beside the package and are not in the wheel: the package may not
    import them (they import it)."""
    hidden = ast.parse("def f():\n    from benchmarks import kernels\n")
    assert "benchmarks" in {_package(n) for n in _imported_names(hidden, "specserve.bench.cli")}  # lazy ones count
    offenders = {
        module: sorted(n for n in _imported_names(ast.parse(path.read_text()), module) if _package(n) in ("benchmarks", "scripts"))
        for module, path in MODULES.items()
    }
    assert {m: found for m, found in offenders.items() if found} == {}


@pytest.mark.unit
def test_no_role_imports_another_role():
    offenders = {
        module: sorted(m for m in GRAPH[module] if _role(m) not in (None, _role(module)))
        for module in GRAPH
        if _role(module) is not None
    }
    assert {m: found for m, found in offenders.items() if found} == {}


# --------------------------------------------------------------------------- the round loop and the pool


@pytest.mark.unit
def test_the_round_loop_uses_only_the_pools_public_methods():
    from specserve.coordinator.fleet.pool import WorkerPool

    public = {
        name for name, value in vars(WorkerPool).items() if not name.startswith("_") and callable(value)
    }
    assert {"propose", "verify", "release"} <= public
    tree = ast.parse((ROOT / "specserve" / "coordinator" / "round.py").read_text())
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "pool") or (
                isinstance(owner, ast.Attribute) and owner.attr == "pool"
            ):
                used.add(node.attr)
    assert used, "the round loop must use the pool"
    assert used <= public, f"rounds.py reaches into the pool: {sorted(used - public)}"


@pytest.mark.unit
def test_the_round_is_one_short_step():
    tree = ast.parse((ROOT / "specserve" / "coordinator" / "round.py").read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RoundLoop")
    step = next(n for n in loop.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "step")
    lines = step.end_lineno - step.lineno + 1
    assert lines <= 10, f"RoundLoop.step has {lines} lines (its def and docstring included)"


#: The modules of the roles that may import the wire (``specserve.v1``): where it is converted.
WIRE_EDGES = frozenset(
    {
        "specserve.coordinator.fleet.clients",  # the coordinator's one client of the workers
        # each role's servicer converts its calls and replies to and from the domain types (the workers'
        # messages.py, the coordinator's params and events), and its server builds the gRPC server
        *(f"{role}.{m}" for role in ROLES for m in ("servicer", "server")),
    }
)


@pytest.mark.unit
def test_inside_the_roles_only_the_edges_import_the_wire():
    assert WIRE_EDGES <= set(MODULES), sorted(WIRE_EDGES - set(MODULES))
    assert "specserve.v1.target_pb2" in GRAPH["specserve.coordinator.fleet.clients"]  # the rule can fail
    offenders = {
        module: sorted(m for m in GRAPH[module] if _within(m, "specserve.v1"))
        for module in GRAPH
        if _role(module) is not None and module not in WIRE_EDGES
    }
    assert {m: found for m, found in offenders.items() if found} == {}


@pytest.mark.unit
def test_speculation_imports_nothing_of_the_fleet():
    speculation = [m for m in GRAPH if _within(m, "specserve.coordinator.speculation")]
    assert "specserve.coordinator.speculation.speculator" in speculation
    offenders = {
        module: sorted(m for m in GRAPH[module] if _within(m, "specserve.coordinator.fleet")) for module in speculation
    }
    assert {m: found for m, found in offenders.items() if found} == {}


# --------------------------------------------------------------------------- short functions


@pytest.mark.unit
@pytest.mark.parametrize(
    ("path", "qualname"),
    [("specserve/coordinator/coordinator.py", "Coordinator.generate"), ("specserve/core/verification.py", "verify_batch")],
)
def test_key_functions_stay_under_50_lines(path, qualname):
    tree = ast.parse((ROOT / path).read_text())
    *owner, name = qualname.split(".")
    scope: ast.AST = tree
    for part in owner:
        scope = next(n for n in ast.iter_child_nodes(scope) if isinstance(n, ast.ClassDef) and n.name == part)
    func = next(
        n
        for n in ast.iter_child_nodes(scope)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    )
    lines = func.end_lineno - func.lineno + 1
    assert lines < 50, f"{qualname} has {lines} lines"


# --------------------------------------------------------------------------- docs


INTERNALS = (ROOT / "docs" / "internals.md").read_text()
FILE_NAME = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|proto|md|toml|yaml))`")


@pytest.mark.unit
def test_internals_names_only_files_that_exist():
    named = set(FILE_NAME.findall(INTERNALS))
    assert len(named) > 30
    missing = sorted(n for n in named if not (ROOT / n).exists() and not (ROOT / "docs" / n).exists())
    assert missing == [], f"docs/internals.md names files that do not exist: {missing}"


@pytest.mark.unit
def test_internals_walks_one_round_through_at_most_six_files_in_order():
    """A newcomer's walk through one round starts at ``round.py`` and names at most 6 files (issue 55)."""
    section = INTERNALS.split("## One round, file by file", 1)[1].split("\n## ", 1)[0]
    walked = [n for n in FILE_NAME.findall(section) if "/" in n]
    order = [
        "specserve/coordinator/round.py",
        "specserve/coordinator/speculation/speculator.py",
        "specserve/coordinator/fleet/pool.py",
        "specserve/draft/proposers.py",
        "specserve/target/verifier.py",
        "specserve/core/verification.py",
    ]
    assert sorted(set(walked)) == sorted(order), "the walk names exactly these files"
    firsts = [walked.index(n) for n in order]
    assert firsts == sorted(firsts), "... each first named in the order the data flows"


@pytest.mark.system
def test_nothing_points_at_design_notes_outside_the_repository():
    banned = ["../" + "shared", "STYLE" + ".md", "DESIGN" + ".md"]
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if (
            name.startswith("models/")
            or path.suffix in {".png", ".json", ".safetensors"}
            or not path.is_file()
        ):
            continue
        text = path.read_text(errors="ignore")
        found += [f"{name}: {b}" for b in banned if b in text]
    assert found == []
