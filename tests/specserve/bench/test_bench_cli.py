"""specserve.bench.cli and specserve.bench.options: ``specserve bench`` is one subcommand per benchmark, each
with its own typed options; bad options are refused naming the option, before anything runs; ``report``
renders docs/benchmarks' sections again from their JSON, column for column."""

from __future__ import annotations

import dataclasses
import json
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


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        launcher.main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for command in cli.SUBCOMMANDS:
        assert command.name in text
    names = [c.name for c in cli.SUBCOMMANDS]
    assert len(names) == len(set(names)) and {"all", "single", "load", "latency", "report"} <= set(names)


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
    _, opts = cli.parse(["kernels", "--out", "/tmp/x"])
    assert opts.out == Path("/tmp/x") and opts.threads is None
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
        (["sampling-modes", "--gammas", "auto", "x"], "--gammas takes 'auto' or integers"),
        (["invariance", "--threads", "2"], "--clock cpu measures one thread"),
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


@pytest.mark.parametrize("name", ["draft_scaling", "prediction"])
def test_report_renders_a_stored_section_again_column_for_column(name, tmp_path):
    """docs/benchmarks' section files are what ``specserve bench report`` renders from their JSON."""
    shutil.copy(DOCS / f"{name}.json", tmp_path / f"{name}.json")
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / f"{name}.md").read_text() == (DOCS / f"{name}.md").read_text()
