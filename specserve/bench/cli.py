"""``specserve bench``: the benchmarks, one subcommand each, each with its own typed options
(:mod:`specserve.bench.options`); docs/benchmarks holds what they write.

    specserve bench gate                                      # the speed gate (a few minutes)
    specserve bench all --prompts 2 --max-new-tokens 64 ...   # every figure of the report (bench.json)
    specserve bench single | load | latency | draft-scaling | sampling-modes | prediction ...
    specserve bench overhead | kernels | invariance | attention | draft-card | head-card | demo-pair ...
    specserve bench constraints | greedy-identity | prefix-cache | prefix-cache-memory | structured ...
    specserve bench report docs/benchmarks                    # render the reports again from their JSON

``python -m specserve.bench`` is the same command. A subcommand's module is imported only when it runs, so
``--help`` loads no model code.
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
    Subcommand("draft-scaling", o.DraftScalingOptions, f"{HARNESS}:bench_draft_scaling"),
    Subcommand("sampling-modes", o.SamplingModesOptions, f"{HARNESS}:bench_sampling_modes"),
    Subcommand("prediction", o.PredictionOptions, f"{HARNESS}:bench_prediction"),
    Subcommand("overhead", o.OverheadOptions, "specserve.bench.overhead:main"),
    Subcommand("kernels", o.KernelsOptions, "specserve.bench.kernels:main"),
    Subcommand("invariance", o.InvarianceOptions, "specserve.bench.invariance:main"),
    Subcommand("attention", o.AttentionOptions, "specserve.bench.attention:main"),
    Subcommand("draft-card", o.DraftCardOptions, "specserve.bench.draft_card:main"),
    Subcommand("head-card", o.HeadCardOptions, "specserve.bench.head_card:main"),
    Subcommand("demo-pair", o.DemoPairOptions, "specserve.bench.demo_pair:main"),
    Subcommand("constraints", o.ConstraintsOptions, "specserve.bench.constraints:main"),
    Subcommand("greedy-identity", o.GreedyIdentityOptions, "specserve.bench.greedy_identity:main"),
    Subcommand("prefix-cache", o.PrefixCacheOptions, "specserve.bench.prefix_cache:main"),
    Subcommand("prefix-cache-memory", o.PrefixCacheMemoryOptions, "specserve.bench.prefix_cache:main_memory"),
    Subcommand("structured", o.StructuredOptions, "specserve.bench.structured:main"),
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
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for command in SUBCOMMANDS:
        p = sub.add_parser(
            command.name,
            aliases=list(command.aliases),
            help=_summary(command.options),
            description=command.options.__doc__,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        o.add_arguments(p, command.options)
        p.set_defaults(_command=command, _parser=p)
    return parser


def parse(argv: Sequence[str]) -> tuple[Subcommand, o.Options]:
    """The subcommand ``argv`` names and its options (argparse's usage error, exit status 2, for bad ones)."""
    ns = build_parser().parse_args(list(argv))
    command: Subcommand = ns._command
    try:
        return command, o.parse(command.options, ns, "specserve bench " + shlex.join(argv))
    except ValueError as exc:
        ns._parser.error(str(exc))
        raise  # unreachable: error() exits


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, opts = parse(argv)
    return command.runner()(opts)
