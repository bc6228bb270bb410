"""The wire contract: committed stubs match a fresh generation, and buf lint is clean."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[3]


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos():
    gen = _gen_protos()
    assert len(list((ROOT / "specserve" / "v1").glob("*_pb2*"))) == 12  # 4 protos x (pb2, pyi, grpc)
    assert gen.stale() == []
    # The command CI's users run gives the same answer.
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"])
    assert check.returncode == 0


def test_an_edited_proto_without_regenerated_stubs_fails_the_check(tmp_path):
    gen = _gen_protos()
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos)
    draft = protos / "specserve" / "v1" / "draft.proto"
    text = draft.read_text()
    assert "message ProposeResponse {" in text
    draft.write_text(text.replace(
        "message ProposeResponse {", "message ProposeResponse {\n  // A field the stubs do not know.\n  uint32 extra = 99;", 1
    ))
    problems = gen.stale(protos)
    assert "specserve/v1/draft_pb2.py: stale" in problems
    assert "specserve/v1/draft_pb2.pyi: stale" in problems
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check", "--protos", str(protos)],
        capture_output=True, text=True,
    )
    assert check.returncode == 1 and "draft_pb2.py: stale" in check.stderr


def test_a_new_rpc_without_regenerated_stubs_fails_the_check(tmp_path):
    gen = _gen_protos()
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos)
    draft = protos / "specserve" / "v1" / "draft.proto"
    text = draft.read_text()
    marker = "service DraftService {"
    assert marker in text
    draft.write_text(text.replace(
        marker, marker + "\n  // An RPC the stubs do not know.\n  rpc Extra(ProposeRequest) returns (ProposeResponse);", 1
    ))
    assert "specserve/v1/draft_pb2_grpc.py: stale" in gen.stale(protos)


def test_a_generator_release_alone_does_not_fail_the_check(tmp_path):
    """Stubs written by another grpcio-tools release (only the version stamps differ) match the protos."""
    gen = _gen_protos()
    stubs = tmp_path / "specserve" / "v1"
    shutil.copytree(ROOT / "specserve" / "v1", stubs)
    changed = 0
    for path in stubs.glob("*_pb2*.py"):
        text = path.read_text()
        new = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.9'", text)
        new = re.sub(r"# Protobuf Python Version: .*", "# Protobuf Python Version: 9.99.9", new)
        new = re.sub(r"(Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,", r"\1\n    9,\n    99,\n    9,", new)
        changed += new != text
        path.write_text(new)
    assert changed == 8  # every pb2 and pb2_grpc module carries a stamp
    assert gen.stale(committed_root=tmp_path) == []


def test_the_committed_stubs_come_from_the_pinned_generator():
    """Bumping the grpcio-tools pin is one commit that regenerates the stubs (docs/internals.md)."""
    pin = re.search(r'"grpcio-tools==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "grpcio-tools is pinned exactly in pyproject.toml's test extra"
    for path in (ROOT / "specserve" / "v1").glob("*_pb2_grpc.py"):
        stamp = re.search(r"GRPC_GENERATED_VERSION = '([^']*)'", path.read_text())
        assert stamp and stamp.group(1) == pin.group(1), f"{path.name} was written by grpcio-tools {stamp.group(1)}"


def test_buf_lint_standard_is_clean():
    buf = shutil.which("buf")
    if buf is None:
        if os.environ.get("CI"):
            pytest.fail("buf is not installed in CI (npm install -g @bufbuild/buf)")
        pytest.skip("buf not installed (npm install -g @bufbuild/buf)")
    config = (ROOT / "protos" / "buf.yaml").read_text()
    assert "STANDARD" in config
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_field_is_documented():
    """docs/design.md, "Conventions" (protos): a comment on every field, message, enum value, service and RPC."""
    undocumented = []
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            text = line.strip()
            declares = text.startswith(("message ", "service ", "enum ", "rpc ", "oneof ")) or (
                text.endswith(";") and "=" in text and not text.startswith(("syntax", "option"))
            )
            if declares and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {text}")
    assert not undocumented, "\n".join(undocumented)
