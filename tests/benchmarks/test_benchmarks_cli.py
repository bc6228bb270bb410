"""benchmarks.cli and benchmarks.report: ``python -m benchmarks`` is one subcommand per one-off experiment, each
with the options class it had under ``specserve bench`` (the command it records names the new entry point);
bad options are refused naming the option; a script parses its own arguments; ``report`` renders the
experiments' reports in docs/benchmarks again from their JSON, column for column."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks import options as o
from benchmarks.report import RENDERERS
from specserve.bench import cli as bench_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks"


@pytest.mark.unit
@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__main__"))
def test_every_experiment_module_imports(module):
    # A script parses its arguments only when run, so a stale import showed only then (prefix-cache-openai's did).
    importlib.import_module(f"benchmarks.{module}")


@pytest.mark.unit
def test_every_experiment_is_listed_and_none_is_specserve_bench(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in cli.names())
    assert len(cli.names()) == len(set(cli.names()))
    product = {n for c in bench_cli.SUBCOMMANDS for n in (c.name, *c.aliases)}
    assert product & set(cli.names()) == {"report"}  # benchmarks' report renders the product's too
    assert {"kernels", "invariance", "overhead", "structured", "prefix-cache", "bf16"} <= set(cli.names())


@pytest.mark.unit
def test_an_experiment_without_options_gets_its_own_defaults():
    for command in cli.EXPERIMENTS:
        name, opts = bench_cli.parse([command.name], cli.build_parser())
        assert name is command and type(opts) is command.options
        assert opts == dataclasses.replace(command.options(), command=f"python -m benchmarks {command.name}")
        json.dumps(opts.settings())  # what the run's JSON records


@pytest.mark.unit
def test_options_are_typed_as_before():
    _, opts = bench_cli.parse(["kernels", "--out", "/tmp/x"], cli.build_parser())
    assert isinstance(opts, o.KernelsOptions) and opts.out == Path("/tmp/x") and opts.threads is None
    _, opts = bench_cli.parse(["structured", "--parts", "flood", "--repeats", "2"], cli.build_parser())
    assert opts.parts == ["flood"] and opts.repeats == 2
    assert opts.command == "python -m benchmarks structured --parts flood --repeats 2"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["sampling-modes", "--gammas", "auto", "x"], "--gammas takes 'auto' or integers"),
        (["invariance", "--threads", "2"], "--clock cpu measures one thread"),
        (["draft-scaling", "--draft-batch", "1"], "--draft-batch must be >= 2"),
        (["structured", "--slow-patterns", "0"], "--slow-patterns must be >= 1"),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and f"python -m benchmarks {argv[0]}" in err


@pytest.mark.unit
def test_a_script_parses_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["session-churn", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--sessions" in out and "--concurrency" in out


@pytest.mark.unit
def test_guidellm_table_prints_a_row_per_report(tmp_path, capsys):
    ok = {"successful": {"median": 12.5, "total_sum": 400}}
    report = {"benchmarks": [{
        "config": {"strategy": {"streams": 4}}, "duration": 10.0,
        "metrics": {"request_totals": {"successful": 8, "total": 8}, "output_token_count": ok,
                    "time_to_first_token_ms": ok, "inter_token_latency_ms": ok, "request_latency": ok},
    }]}  # fmt: skip
    (tmp_path / "c4.json").write_text(json.dumps(report))
    assert cli.main(["guidellm-table", str(tmp_path / "c4.json")]) == 0
    assert "| 4 | 8 of 8 | 40.0 | 12 | 12.5 | 12.50 |" in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_report_renders_a_stored_report_again_column_for_column(name, tmp_path):
    """docs/benchmarks' experiment reports are what ``python -m benchmarks report`` renders from their JSON."""
    shutil.copy(DOCS / f"{name}.json", tmp_path / f"{name}.json")
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / f"{name}.md").read_text() == (DOCS / f"{name}.md").read_text()


@pytest.mark.system
def test_python_m_benchmarks_runs_from_the_repository_root():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "python -m benchmarks" in done.stdout and "kernels" in done.stdout
