"""The wire contract: committed stubs match a fresh generation, and buf lint is clean."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[3]


def test_committed_stubs_match_fresh_generation(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True
    )
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "specserve" / "v1").glob("*_pb2*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "specserve" / "v1").glob("*_pb2*"))
    assert fresh == committed, "stub files differ: run python scripts/gen_protos.py"
    assert len(fresh) == 12  # 4 protos x (pb2, pyi, grpc)
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), (
            f"{rel} is stale: run python scripts/gen_protos.py and commit the result"
        )


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
