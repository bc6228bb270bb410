"""The one Markdown renderer of the benchmark reports: tables, the command block, the greedy-output line,
and writing a report (and its JSON) to a folder.

Every report module (:mod:`specserve.bench.report` and the modes' ``section``/``render`` functions) builds its
lines from these pieces; docs/benchmarks holds what they render.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: The rule under a column: left-aligned (the default) or right-aligned.
LEFT, RIGHT = "---", "---:"


def row(cells: Iterable[object]) -> str:
    """One table row: ``| a | b |`` (an empty cell: ``| |``)."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table(header: Sequence[str], rows: Iterable[Iterable[object]], *, align: Sequence[str] | None = None) -> list[str]:
    """A Markdown table's lines: the header, its rule (``align``: a :data:`LEFT`/:data:`RIGHT` per column,
    default all left) and one line per row, each cell ``str()``-ed."""
    rule = align if align is not None else [LEFT] * len(header)
    if len(rule) != len(header):
        raise ValueError(f"{len(header)} columns but {len(rule)} alignments")
    return [row(header), row(rule), *(row(r) for r in rows)]


def command_block(command: str) -> list[str]:
    """The command a report's figures come from, as a fenced block and a blank line."""
    return [f"```\n{command}\n```", ""]


def load_line(data: dict[str, Any]) -> str:
    """The sentence on the machine's load average around a run (``load_average``, from
    :func:`specserve.bench.runner.run_mode`), or '' for runs without it."""
    load = data.get("load_average")
    if not load:
        return ""

    def avg(xs: list[float]) -> str:
        return "/".join(f"{x:.2f}" for x in xs)

    return (
        f"Load average (1/5/15 min, as `uptime` gives it) on {load['cpus']} CPUs: {avg(load['before'])} before the "
        f"run, {avg(load['after'])} after."
    )


def greedy_line(runs: list[dict[str, Any]], max_new_tokens: int, between: str) -> tuple[int, str]:
    """How many of ``runs`` (``identical``/``prompt``/``first_difference`` each) were token-identical
    ``between`` two paths, and the sentence saying so (its closing punctuation left to the caller)."""
    same = sum(g["identical"] for g in runs)
    text = (
        f"Greedy output, HF `generate()` of {len(runs)} held-out chat and code prompts, {max_new_tokens} tokens "
        f"each (EOS ignored){between}: **{same} of {len(runs)} token-identical**"
    )
    return same, text


def first_differences(runs: list[dict[str, Any]]) -> str:
    """``prompt: token N, ...`` of the runs whose outputs differed."""
    return ", ".join(f"{g['prompt']}: token {g['first_difference']}" for g in runs if not g["identical"])


def write(out: Path, name: str, text: str | list[str], data: dict[str, Any] | None = None) -> Path:
    """``<out>/<name>.md`` from ``text`` (lines are joined by newlines), and ``<out>/<name>.json`` from
    ``data`` where given; returns the Markdown file's path."""
    out.mkdir(parents=True, exist_ok=True)
    if data is not None:
        write_json(out / f"{name}.json", data)
    path = out / f"{name}.md"
    path.write_text(text if isinstance(text, str) else "\n".join(text))
    return path


def write_json(path: Path, data: Any) -> Path:
    """``data`` as the benchmarks store it (indented by one, a final newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
