"""specserve.bench.cli and specserve.bench.options: ``specserve bench`` is one subcommand per benchmark a user
or an operator runs, each with its own typed options, and lists no one-off experiment (those are ``python -m
benchmarks``, tests/benchmarks); bad options are refused naming the option, before anything runs; ``report``
renders docs/benchmarks' sections again from their JSON, column for column."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from specserve.bench import cli
from specserve.bench import options as o
from specserve.bench.modes import SINGLE_MODES, SPEC_MODES
from specserve.launch import cli as launcher

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "benchmarks"


#: What ``specserve bench --help`` lists: the speed gate, the full run and its parts, the model cards, the report.
USER_FACING = {"gate", "all", "single", "load", "latency", "rtt", "draft-card", "head-card", "report"}


def _listed(text: str) -> set[str]:
    """The subcommands (and aliases) argparse's ``--help`` lists, one per line under SUBCOMMAND."""
    return {name for line in re.findall(r"^    ([\w-]+(?: \([\w-]+\))?)", text, flags=re.M)
            for name in re.findall(r"[\w-]+", line)}  # fmt: skip


def test_help_lists_the_user_facing_benchmarks_and_nothing_else(capsys):
    with pytest.raises(SystemExit) as exc:
        launcher.main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert _listed(text) == USER_FACING
    for command in cli.SUBCOMMANDS:
        assert command.name in text
    names = [c.name for c in cli.SUBCOMMANDS]
    assert len(names) == len(set(names))
    for experiment in ("kernels", "invariance", "overhead", "structured", "prefix-cache", "sampling-modes"):
        assert experiment not in _listed(text)


def test_a_subcommand_without_options_gets_its_own_defaults():
    for command in cli.SUBCOMMANDS:
        name, opts = cli.parse([command.name])
        assert name is command and type(opts) is command.options
        assert opts == dataclasses.replace(command.options(), command=f"specserve bench {command.name}")
        json.dumps(opts.settings())  # what the run's JSON records


def test_options_are_typed_from_their_annotations():
    _, opts = cli.parse(["load", "--rates", "2", "4.5", "--duration-s", "1", "--repeats", "2", "--control"])
    assert isinstance(opts, o.LoadOptions)
    assert opts.rates == [2.0, 4.5] and opts.duration_s == 1.0 and opts.repeats == 2 and opts.control is True
    assert opts.command == "specserve bench load --rates 2 4.5 --duration-s 1 --repeats 2 --control"
    _, opts = cli.parse(["rtt", "--sides", "draft", "--rtts-ms", "0", "3"])  # latency's alias
    assert isinstance(opts, o.LatencyOptions) and opts.sides == ["draft"] and opts.rtts_ms == [0.0, 3.0]
    _, opts = cli.parse(["draft-card", "--json", "/tmp/x", "--sampled-gammas", "1", "2"])
    assert opts.json == Path("/tmp/x") and opts.sampled_gammas == [1, 2] and opts.draft is None
    _, opts = cli.parse(["report", "/tmp/y"])
    assert opts.folder == Path("/tmp/y")


def test_each_subcommand_takes_only_its_own_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(["latency", "--rates", "2"])  # the load sweep's option
    assert exc.value.code == 2 and "--rates" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["load", "--repeats", "0"], "--repeats must be >= 1"),
        (["all", "--load-repeats", "0"], "--load-repeats must be >= 1"),
        (["single", "--draft-batch", "0"], "--draft-batch must be >= 1"),
        (["gate", "--setting", "target"], "--setting 'target': write ROLE.KEY=VALUE"),
        (["latency", "--sides", "both"], "--sides"),
        (["single", "--modes", "specserve gamma=3"], "--modes"),
        (["load", "--kernels", "fast"], "--kernels"),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and f"specserve bench {argv[0]}" in err


def test_the_single_modes_are_named_once():
    assert len(SINGLE_MODES) == len(set(SINGLE_MODES))
    assert [m.name for m in SPEC_MODES] == [m for m in SINGLE_MODES if m.startswith("specserve ")]


def test_report_renders_the_full_report_again_linking_the_others(tmp_path):
    """docs/benchmarks/README.md is what ``specserve bench report`` renders from bench.json and the latency runs,
    with a link to every other report beside it."""
    names = ["bench.json", "latency.json", "latency_draft.json", "latency_head.json"]
    for name in names:
        shutil.copy(DOCS / name, tmp_path / name)
    for md in DOCS.glob("*.md"):
        if md.name != "README.md":
            (tmp_path / md.name).write_text(md.read_text())
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == (DOCS / "README.md").read_text()
