"""``specserve bench``: the benchmarks a user or an operator runs, one subcommand each, each with its own typed
options (:mod:`specserve.bench.options`); docs/benchmarks holds what they write.

    specserve bench gate                                      # the speed gate (a few minutes)
    specserve bench all --prompts 2 --max-new-tokens 64 ...   # every figure of the report (bench.json)
    specserve bench single | load | latency ...               # one part of it alone
    specserve bench draft-card | head-card ...                # a draft's or a feature head's model card
    specserve bench report docs/benchmarks                    # render the reports again from their JSON

``python -m specserve.bench`` is the same command. A subcommand's module is imported only when it runs, so
``--help`` loads no model code. The one-off experiments behind the other reports in docs/benchmarks are not
part of the package: ``python -m benchmarks`` in a checkout runs them, with this module's parser.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specserve.bench import options as o


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its name (and aliases), its options class and what runs it (``module:function``, which
    takes the options and returns the exit status)."""

    name: str
    options: type[o.Options]
    run: str
    aliases: tuple[str, ...] = ()

    def runner(self) -> Callable[[Any], int]:
        module, function = self.run.split(":")
        return getattr(importlib.import_module(module), function)


HARNESS = "specserve.bench.harness"
SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("gate", o.GateOptions, "specserve.bench.gate:main"),
    Subcommand("all", o.FullOptions, f"{HARNESS}:bench_all"),
    Subcommand("single", o.SingleOptions, f"{HARNESS}:bench_single"),
    Subcommand("load", o.LoadOptions, f"{HARNESS}:bench_load"),
    Subcommand("latency", o.LatencyOptions, f"{HARNESS}:bench_latency", aliases=("rtt",)),
    Subcommand("draft-card", o.DraftCardOptions, "specserve.bench.draft_card:main"),
    Subcommand("head-card", o.HeadCardOptions, "specserve.bench.head_card:main"),
    Subcommand("report", o.ReportOptions, "specserve.bench.report:main"),
)


def _summary(cls: type) -> str:
    """The options class's first paragraph without its ``name``: prefix, for the subcommand list."""
    return (cls.__doc__ or "").split("\n\n")[0].split(": ", 1)[-1].replace("\n", " ").strip()


def build_parser() -> argparse.ArgumentParser:
    """``specserve bench`` with one subparser per :data:`SUBCOMMANDS` entry."""
    parser = argparse.ArgumentParser(
        prog="specserve bench",
        description="The benchmarks, one subcommand each, each with options of its own (specserve bench "
        "SUBCOMMAND --help); docs/benchmarks holds what they write.",
    )
    add_subcommands(parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND"), SUBCOMMANDS)
    return parser


def add_subcommands(sub: Any, subcommands: Sequence[Subcommand]) -> None:
    """One subparser of ``sub`` (``add_subparsers()``'s action) per subcommand, its options from its class."""
    for command in subcommands:
        p = sub.add_parser(
            command.name,
            aliases=list(command.aliases),
            help=_summary(command.options),
            description=command.options.__doc__,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        o.add_arguments(p, command.options)
        p.set_defaults(_command=command, _parser=p)


def parse(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> tuple[Subcommand, o.Options]:
    """The subcommand ``argv`` names and its options (argparse's usage error, exit status 2, for bad ones);
    ``parser``: another command line built with :func:`add_subcommands` (default: ``specserve bench``'s)."""
    parser = parser or build_parser()
    ns = parser.parse_args(list(argv))
    command: Subcommand = ns._command
    try:
        return command, o.parse(command.options, ns, f"{parser.prog} {shlex.join(argv)}")
    except ValueError as exc:
        ns._parser.error(str(exc))
        raise  # unreachable: error() exits


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, opts = parse(argv)
    return command.runner()(opts)
