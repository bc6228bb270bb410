"""Prompt sets for the benchmark, cut from held-out standard-library files.

* ``code``: a held-out file up to and including a ``def`` line (the model
  continues the function body).
* ``prose``: the opening of a held-out module's docstring (English text as the
  models saw it, inside code).

The held-out list is the one the demo pair was trained without
(``heldout_files.json`` in the model directory); without it, any sorted stdlib
files are used and the report says so.
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    name: str  # "<set>/<file>:<line>"
    text: str


def heldout_files(model_dir: Path) -> tuple[list[Path], bool]:
    """Held-out stdlib files named by the model directory, and whether that list was found."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listing = model_dir / "heldout_files.json"
    if listing.exists():
        data = json.loads(listing.read_text())
        names = data["files"] if isinstance(data, dict) else data
        files = [stdlib / n for n in names if (stdlib / n).exists()]
        if files:
            return files, True
    return sorted(stdlib.glob("*.py")), False


_DEF = re.compile(r"^(\s*)def \w+\(.*\).*:\s*$")


def code_prompts(files: list[Path], n: int, max_chars: int = 600) -> list[Prompt]:
    out: list[Prompt] = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(lines):
            if i > 20 and _DEF.match(line) and i + 1 < len(lines):
                text = "".join(lines[: i + 1])[-max_chars:]
                out.append(Prompt(f"code/{path.name}:{i + 1}", text))
                break
        if len(out) == n:
            break
    return out


def prose_prompts(files: list[Path], n: int, max_chars: int = 300) -> list[Prompt]:
    out: list[Prompt] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            doc = ast.get_docstring(ast.parse(source), clean=False)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if not doc or len(doc) < 200:
            continue
        start = source.find(doc[:40])
        if start < 0:
            continue
        cut = source[: start + min(len(doc) // 2, max_chars)]
        out.append(Prompt(f"prose/{path.name}", cut[-(max_chars + 40) :]))
        if len(out) == n:
            break
    return out
