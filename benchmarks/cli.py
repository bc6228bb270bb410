"""``python -m benchmarks``: the one-off experiments, one subcommand each, from a checkout of the repository.

    python -m benchmarks --help                                   # every experiment, one line each
    python -m benchmarks kernels --out docs/benchmarks            # an experiment, its options its own
    python -m benchmarks report docs/benchmarks                   # every report there, again from its JSON

An experiment with an options class (:mod:`benchmarks.options`) is parsed as ``specserve bench``'s
subcommands are (:mod:`specserve.bench.cli`) and records its command line with its figures; a script
(:data:`SCRIPTS`) parses its own arguments.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks import options as o
from specserve.bench import cli
from specserve.bench.cli import Subcommand
from specserve.bench.options import ReportOptions

EXPERIMENTS: tuple[Subcommand, ...] = (
    Subcommand("draft-scaling", o.DraftScalingOptions, "benchmarks.draft_scaling:main"),
    Subcommand("sampling-modes", o.SamplingModesOptions, "benchmarks.sampling_modes:main"),
    Subcommand("prediction", o.PredictionOptions, "benchmarks.prediction:main"),
    Subcommand("overhead", o.OverheadOptions, "benchmarks.overhead:main"),
    Subcommand("kernels", o.KernelsOptions, "benchmarks.kernels:main"),
    Subcommand("invariance", o.InvarianceOptions, "benchmarks.invariance:main"),
    Subcommand("attention", o.AttentionOptions, "benchmarks.attention:main"),
    Subcommand("demo-pair", o.DemoPairOptions, "benchmarks.demo_pair:main"),
    Subcommand("constraints", o.ConstraintsOptions, "benchmarks.constraints:main"),
    Subcommand("greedy-identity", o.GreedyIdentityOptions, "benchmarks.greedy_identity:main"),
    Subcommand("prefix-cache", o.PrefixCacheOptions, "benchmarks.prefix_cache:main"),
    Subcommand("prefix-cache-memory", o.PrefixCacheMemoryOptions, "benchmarks.prefix_cache:main_memory"),
    Subcommand("structured", o.StructuredOptions, "benchmarks.structured:main"),
    Subcommand("trees", o.TreesOptions, "benchmarks.trees:main"),
    Subcommand("coupled-lists", o.CoupledListsOptions, "benchmarks.coupled_lists:main"),
    Subcommand("tree-expansion", o.TreeExpansionOptions, "benchmarks.tree_expansion:main"),
    Subcommand("tree-sampling", o.TreeSamplingOptions, "benchmarks.tree_sampling:main"),
    Subcommand("tree-verify", o.TreeVerifyOptions, "benchmarks.tree_verify:main"),
    Subcommand("report", ReportOptions, "benchmarks.report:main"),
)


@dataclass(frozen=True)
class Script:
    """An experiment that parses its own arguments: its name, its module (whose ``main(argv)`` runs it) and
    its one-line summary."""

    name: str
    module: str
    summary: str

    def run(self, argv: Sequence[str]) -> int:
        return importlib.import_module(self.module).main(list(argv)) or 0


SCRIPTS: tuple[Script, ...] = (
    Script("bf16", "benchmarks.bf16", "bfloat16 against float32 for the target and the draft on this CPU"),
    Script("session-churn", "benchmarks.session_churn", "many one-token sessions from one client against a running stack"),
    Script("prefix-cache-openai", "benchmarks.prefix_cache_openai",
           "a 6-turn chat of default requests through the openai client, prefix cache on and off"),
    Script("prefix-cache-prefill", "benchmarks.prefix_cache_prefill",
           "the target's prefill work per turn of a chat, prefix cache on and off, in CPU time"),
    Script("prefix-cache-tenancy", "benchmarks.prefix_cache_tenancy",
           "time to first token of a prompt another API key sent first"),
    Script("guidellm-table", "benchmarks.guidellm_table", "docs/benchmarks/tools.md's table from guidellm's reports"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks`` with one subparser per experiment (a script's lists it for ``--help`` only)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The one-off experiments behind docs/benchmarks, one subcommand each (python -m benchmarks "
        "NAME --help); the benchmarks a user runs are `specserve bench`.",
    )
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="NAME")
    cli.add_subcommands(sub, EXPERIMENTS)
    for script in SCRIPTS:
        sub.add_parser(script.name, help=script.summary, add_help=False)
    return parser


def names() -> list[str]:
    """Every subcommand's name (aliases included)."""
    return [n for c in EXPERIMENTS for n in (c.name, *c.aliases)] + [s.name for s in SCRIPTS]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script = next((s for s in SCRIPTS if argv and argv[0] == s.name), None)
    if script is not None:
        return script.run(argv[1:])
    command, opts = cli.parse(argv, build_parser())
    return command.runner()(opts)
