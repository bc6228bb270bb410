"""Regenerate the Python stubs in ``specserve/v1/`` from ``protos/``, or check the committed ones.

Run from anywhere: ``python scripts/gen_protos.py`` writes them (commit the result);
``python scripts/gen_protos.py --check`` exits 1 naming every stub the protos no longer match.

The check compares what the protos determine: a fresh generation against the committed files, with
the generator's own version stamps left out (``GRPC_GENERATED_VERSION`` in ``*_pb2_grpc.py``, the
protobuf version in a ``*_pb2.py`` header and its runtime check), so a patch release of grpcio-tools
cannot fail it while an edited proto without regenerated stubs always does. grpcio-tools is pinned
exactly in ``pyproject.toml``'s ``test`` extra; bumping it is one commit that regenerates the stubs
(docs/internals.md, "Installing, and regenerating what is generated").
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
STUBS = Path("specserve") / "v1"

# What a generator release changes without any proto changing: its version stamps.
_STAMPS = (
    re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"),
)


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(proto_root.rglob("*.proto"))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir``."""
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(proto_root)) for p in proto_files(proto_root)],
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def without_stamps(text: str) -> str:
    """A stub's text with the generator's version stamps blanked out."""
    for stamp in _STAMPS:
        text = stamp.sub(lambda m: m.group(1) if m.groups() else "", text)
    return text


def stale(proto_root: Path = PROTO_ROOT, committed_root: Path = ROOT) -> list[str]:
    """The committed stubs under ``committed_root`` that a fresh generation from ``proto_root`` does not
    match (missing, extra or different beyond version stamps), as messages; empty when all match."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out, proto_root)
        fresh = {p.name: p.read_text() for p in (out / STUBS).glob("*_pb2*")}
    committed = {p.name: p.read_text() for p in (committed_root / STUBS).glob("*_pb2*")}
    problems = [f"{STUBS / name}: missing" for name in sorted(fresh.keys() - committed.keys())]
    problems += [f"{STUBS / name}: no proto generates it" for name in sorted(committed.keys() - fresh.keys())]
    problems += [
        f"{STUBS / name}: stale"
        for name in sorted(fresh.keys() & committed.keys())
        if without_stamps(fresh[name]) != without_stamps(committed[name])
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the committed stubs are stale")
    parser.add_argument("--protos", type=Path, default=PROTO_ROOT, help="proto root (default: protos/)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.protos, args.out)
        for problem in problems:
            print(f"{problem}: run python scripts/gen_protos.py and commit the result", file=sys.stderr)
        return 1 if problems else 0
    generate(args.out, args.protos)
    return 0


if __name__ == "__main__":
    sys.exit(main())
