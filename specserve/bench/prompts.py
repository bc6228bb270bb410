"""Prompt sets for the benchmark: held-out chat conversations (:mod:`specserve.prompts.chat`) and cuts
of held-out standard-library files.

* ``chat``, ``chat-code``, ``copy``: first turns of held-out conversations through the tokenizer's chat
  template (:func:`load_prompt_sets`).

* ``translate``, ``summarize``, ``passage-qa``, ``arithmetic``, ``rewrite``: held-out tasks on a given text
  (:mod:`specserve.bench.task_prompts`), through the chat template.

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

from specserve.bench.task_prompts import KINDS as TASK_KINDS
from specserve.bench.task_prompts import task_prompts
from specserve.prompts.chat import copy_prompts, heldout_prompts


@dataclass(frozen=True)
class Prompt:
    name: str  # "<set>/<file>:<line>"
    text: str


def heldout_files(model_dir: str | Path) -> tuple[list[Path], bool]:
    """Held-out stdlib files named by the model directory, and whether that list was found."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listing = Path(model_dir) / "heldout_files.json"
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


def default_prompt_sets(tokenizer, *, copy: bool = False) -> list[str]:
    """``chat chat-code`` (and ``copy`` if asked) for a tokenizer with a chat template, ``code prose`` otherwise."""
    if getattr(tokenizer, "chat_template", None):
        return ["chat", "chat-code", *(["copy"] if copy else [])]
    return ["code", "prose"]


def load_prompt_sets(
    names: list[str], tokenizer, target_dir: Path, n: int, max_chars: int
) -> dict[str, list[tuple[str, list[int]]]]:
    """``{set: [(prompt name, token ids), ...]}``, ``n`` held-out prompts per set."""
    out: dict[str, list[tuple[str, list[int]]]] = {}
    files = None
    for name in names:
        if name in ("chat", "chat-code"):
            prompts = heldout_prompts("chat" if name == "chat" else "code", n)
            out[name] = [(p.name, _chat_ids(tokenizer, p.messages)) for p in prompts]
        elif name == "copy":
            out[name] = [(p.name, _chat_ids(tokenizer, p.messages)) for p in copy_prompts(n)]
        elif name in TASK_KINDS:
            out[name] = [(p.name, _chat_ids(tokenizer, p.messages)) for p in task_prompts(name, n)]
        else:
            if files is None:
                files, _ = heldout_files(target_dir)
            cut = (
                code_prompts(files, n, max_chars)
                if name == "code"
                else prose_prompts(files, n, max_chars // 2)
            )
            out[name] = [(p.name, tokenizer(p.text).input_ids) for p in cut]
        if not out[name]:
            raise ValueError(f"prompt set {name!r} is empty")
    return out


def _chat_ids(tokenizer, messages) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    else:  # a tokenizer without a template (a test pair): the user turns as plain text
        text = "\n".join(m["content"] for m in messages) + "\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]
