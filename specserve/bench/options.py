"""Each ``specserve bench`` subcommand's options, as a typed dataclass that its command line is built from.

A field is an option: ``--field-name``, typed by its annotation (``int``, ``float``, ``str``, ``Path``, a
``Literal`` of choices, ``list[...]`` for several values, ``bool`` for a switch, ``X | None`` where None is the
default's meaning), with its help text beside it (:func:`opt`). :func:`add_arguments` turns a class into argparse
options and :func:`parse` back into the class, whose ``__post_init__`` rejects what no run can do with a
``ValueError`` naming the option. The subcommands themselves are in :mod:`specserve.bench.cli`; what each
measures is in docs/benchmarks.
"""

# ruff: noqa: RUF009  (every default below is opt(), which returns a dataclasses.field)
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specserve.bench.modes import SINGLE_MODES

DEFAULT_TARGET = "smollm2-135m-instruct"  # registered names (specserve.engine.model_registry), or directories
DEFAULT_DRAFT = "specserve-smollm2-draft"
DEFAULT_OUT = Path("docs/benchmarks")
#: Held-out prompt sets (specserve/bench/prompts.py loads them).
PROMPT_SETS = ("chat", "chat-code", "copy", "code", "prose", "translate", "summarize", "passage-qa", "arithmetic", "rewrite")
#: The gammas a feature head's card replays greedily.
HEAD_GAMMAS = (1, 2, 3, 4, 6, 8)
#: The feature head's fixed gamma in the load and RTT sweeps (its card's best projected chat gamma).
HEAD_GAMMA = 2
HEAD_GAMMA_HELP = "the feature head's fixed gamma, run where the draft serves a head (left out, with a message, where not)"
HEAD_HELP = (
    "the draft's feature head: a registered name or directory, 'none', or 'auto' (the default pair's head "
    "with the default draft)"
)
Kernels = Literal["fastest", "auto", "stock", "onednn"]
KERNELS_HELP = (
    "the target's linear-layer kernels (specserve/engine/cpu_kernels.py), in the target service and in the "
    "Hugging Face baselines alike; auto (the target's default): packed where it applies; fastest: both paths "
    "timed as the pair loads and the faster one given to the service too; where the path is onednn, HF "
    "target-only with the stock kernels runs too"
)


def opt(default: Any, help: str | None = None, **argparse_kw: Any) -> Any:
    """A field that is a command-line option: its default, its help and any further ``add_argument``
    keywords (``choices``, ``nargs``, ``metavar``, ``positional=True`` for an argument without a flag)."""
    meta = {"help": help, **argparse_kw}
    if isinstance(default, list | tuple):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _kind(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``| None``, and whether it had it."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per field of the dataclass ``cls`` that has :func:`opt`'s metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue  # not an option (set by the command, such as ``command``)
        meta = dict(f.metadata)
        positional = meta.pop("positional", False)
        kind, _ = _kind(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"default": default, **meta}
        if kind is bool:
            kw["action"] = "store_true"
        else:
            if typing.get_origin(kind) is list:
                kw.setdefault("nargs", "+")
                kind = typing.get_args(kind)[0]
            if typing.get_origin(kind) is Literal:
                kw.setdefault("choices", typing.get_args(kind))
                kind = type(typing.get_args(kind)[0])
            kw["type"] = kind
        if positional:
            parser.add_argument(f.name, nargs="?", **kw)
        else:
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)


def parse(cls: type, ns: argparse.Namespace, command: str) -> Any:
    """``cls`` from the parsed options (its checks raise ``ValueError``), with the command line recorded."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(ns).items() if k in names}, command=command)


def at_least(value: int | float, minimum: int | float, flag: str) -> None:
    if value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


@dataclass
class Options:
    """What every subcommand's options have: the command line, recorded with its figures."""

    command: str = ""

    def pick(self, *names: str) -> dict[str, Any]:
        """These options by name, as keywords for the function that takes them."""
        return {name: getattr(self, name) for name in names}

    def settings(self) -> dict[str, Any]:
        """The options as JSON stores them (paths as strings)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


@dataclass
class PairOptions(Options):
    """The pair under test, where it writes, and the seed."""

    target: str = opt(DEFAULT_TARGET, "a registered model name or a directory")
    draft: str = opt(DEFAULT_DRAFT, "a registered model name or a directory")
    redis_url: str | None = opt(None, "default: a private redis-server")
    out: Path = opt(DEFAULT_OUT, "the folder the JSON and the Markdown go to")
    seed: int = opt(0, "the requests' seed")


@dataclass
class PromptOptions(PairOptions):
    """Which held-out prompts."""

    prompt_sets: list[str] | None = opt(
        None,
        "held-out prompt sets (default: chat chat-code, and copy for the full run, with a chat template; "
        "else code prose)",
        choices=PROMPT_SETS,
    )
    prompts: int = opt(4, "prompts per set")
    prompt_chars: int = opt(600, "characters of each prompt (code, prose)")

    def __post_init__(self) -> None:
        at_least(self.prompts, 1, "--prompts")


@dataclass
class StackOptions(PromptOptions):
    """The stack of one process per role the modes run through."""

    kernels: Kernels = opt("auto", KERNELS_HELP)
    head: str = opt("auto", HEAD_HELP)
    draft_batch: int = opt(32, "sessions the draft drafts per pass (1: batching off)")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.draft_batch, 1, "--draft-batch")


@dataclass
class FullOptions(StackOptions):
    """``all``: single stream, the load sweep and the bound, into bench.json and README.md."""

    max_new_tokens: int = opt(128, "tokens per single-stream generation")
    single_repeats: int = opt(
        1,
        "passes over the single-stream prompts, every other one with the modes in the reverse order (medians "
        "are over prompts and passes)",
    )
    temperatures: list[float] = opt([0.0, 0.7], "single-stream temperatures")
    rates: list[float] = opt([1.0, 2.0, 4.0, 8.0, 16.0], "load: arrival rates, requests per second")
    load_duration_s: float = opt(15.0, "load: seconds of arrivals per point")
    load_max_new_tokens: int = opt(64, "load: tokens per request")
    load_repeats: int = opt(3, "load: measure every point this many times, interleaved; the report gives medians")
    load_control: bool = opt(
        False,
        "load: measure gamma 0 twice at every point (an A/A control: the spread of its ratio is the noise a "
        "comparison of two modes has to clear)",
    )
    head_gamma: int = opt(HEAD_GAMMA, "load: " + HEAD_GAMMA_HELP)
    cost_repeats: int = opt(50, "timings per model cost (the bound's inputs)")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.single_repeats, 1, "--single-repeats")
        at_least(self.load_repeats, 1, "--load-repeats")


@dataclass
class SingleOptions(StackOptions):
    """``single``: the single-stream table alone, into single.json and single.md."""

    max_new_tokens: int = opt(128, "tokens per generation")
    repeats: int = opt(1, "passes over the prompts, every other one with the modes in the reverse order")
    temperatures: list[float] = opt([0.0, 0.7], "temperatures")
    modes: list[str] | None = opt(None, "the modes to run (default: every mode the stack serves)", choices=SINGLE_MODES)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.repeats, 1, "--repeats")


#: The speed gate's held-out kinds: chat and code, and the five task kinds of specserve/bench/task_prompts.py.
GATE_KINDS = ("chat", "chat-code", "translate", "summarize", "passage-qa", "arithmetic", "rewrite")


@dataclass
class GateOptions(PairOptions):
    """``gate``: the speed gate: HF generate(), HF assisted generation, specserve gamma 0, the default request
    and llama.cpp on the same GGUF, interleaved on seven held-out kinds with an A/A control; prints the
    table and the bars, writes gate.json and gate.md and appends the table to docs/benchmarks/history.md
    (specserve/bench/gate.py)."""

    kinds: list[str] = opt(list(GATE_KINDS), "held-out kinds", choices=PROMPT_SETS)
    prompts: int = opt(2, "prompts per kind for chat and chat-code")
    task_prompts: int = opt(2, "prompts per kind for the five task kinds")
    max_new_tokens: int = opt(64, "tokens per generation (EOS ignored)")
    repeats: int = opt(2, "passes over the prompts, every other one with the modes in the reverse order")
    threads: int = opt(2, "torch threads of the HF baselines and llama.cpp threads (the target service takes "
                       "the machine's cores, as `specserve up` does)")
    llama_cpp: Literal["auto", "on", "off"] = opt(
        "auto", "the llama.cpp row (llama-cpp-python on the GGUF the default target comes from): auto runs it "
        "where llama_cpp imports and the target is the default one"
    )
    setting: list[str] = opt([], "ROLE.KEY=VALUE settings of the stack under test (e.g. target.invariant=true), "
                             "to gate a configuration other than the defaults", nargs="*")
    history: Path | None = opt(Path("docs/benchmarks/history.md"), "the file the table is appended to")
    no_history: bool = opt(False, "do not append to --history")

    def __post_init__(self) -> None:
        at_least(self.prompts, 1, "--prompts")
        at_least(self.task_prompts, 1, "--task-prompts")
        at_least(self.repeats, 1, "--repeats")
        at_least(self.threads, 1, "--threads")
        for item in self.setting:
            role, _, rest = item.partition(".")
            if role not in ("target", "draft", "coordinator") or "=" not in rest:
                raise ValueError(f"--setting {item!r}: write ROLE.KEY=VALUE with ROLE target, draft or coordinator")

    def overrides(self) -> dict[str, dict[str, Any]]:
        """``--setting`` by role: ``{"target": {"invariant": "true"}, ...}``."""
        out: dict[str, dict[str, Any]] = {"target": {}, "draft": {}, "coordinator": {}}
        for item in self.setting:
            role, _, rest = item.partition(".")
            key, _, value = rest.partition("=")
            value = value.strip()
            out[role][key.strip()] = {"true": True, "false": False}.get(value.lower(), value)  # a switch: --[no-]key
        return out


@dataclass
class LoadOptions(StackOptions):
    """``load``: the load sweep alone (gamma 0, a fixed gamma, adaptive) on the first prompt set, into
    load.json and load.md; the full report's load section then comes from it."""

    rates: list[float] = opt([1.0, 2.0, 4.0, 8.0, 16.0], "arrival rates, requests per second")
    duration_s: float = opt(15.0, "seconds of arrivals per point")
    max_new_tokens: int = opt(64, "tokens per request")
    repeats: int = opt(3, "measure every point this many times, interleaved; the report gives medians")
    fixed_gamma: int = opt(4, "the fixed gamma beside gamma 0 and adaptive")
    head_gamma: int = opt(HEAD_GAMMA, HEAD_GAMMA_HELP)
    control: bool = opt(False, "measure gamma 0 twice at every point (an A/A control)")
    name: str = opt("load", "the files' name: <out>/<name>.json and <name>.md (load_<x> for further runs; "
                    "the full report's load section comes from load.json alone)")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.repeats, 1, "--repeats")
        at_least(self.duration_s, 0.0, "--duration-s")


@dataclass
class LatencyOptions(PromptOptions):
    """``latency``: round trips injected between the coordinator and one tier, into latency.json and
    latency.md (specserve/bench/latency.py)."""

    prompts: int = opt(3, "held-out prompts (of the first set)")
    rtts_ms: list[float] = opt([0.0, 2.0, 10.0], "round-trip times injected, ms")
    max_new_tokens: int = opt(64, "tokens per generation")
    gamma: int = opt(
        1,
        "the fixed gamma run with and without overlap (a round drafted ahead is used only when every proposed "
        "token is accepted and the bonus token guessed)",
    )
    head_gamma: int = opt(HEAD_GAMMA, HEAD_GAMMA_HELP + "; no overlap twin: no feature round is drafted ahead")
    head: str = opt("auto", HEAD_HELP)
    repeats: int = opt(2, "times each setting runs each prompt, interleaved")
    sides: list[Literal["draft", "target"]] = opt(["draft", "target"], "the tiers put behind the delay, in turn")
    cores: Literal["separate", "shared"] = opt(
        "separate",
        "separate: the draft tier and the coordinator on the first CPU, the target on the others (tiers on "
        "machines of their own; needs 2 CPUs); shared: every role on every core",
    )
    name: str = opt("latency", "the files' name: <out>/<name>.json and <name>.md (latency_<x> for further runs)")


@dataclass
class CardOptions(Options):
    """A model card's figures: greedy and sampled acceptance on held-out prompts, and step costs."""

    target: str | None = opt(None, "default: the registered default target")
    prompts: int = opt(40, "held-out prompts per set (greedy)")
    max_new_tokens: int = opt(128, "tokens per greedy answer")
    sampled_prompts: int = opt(12, "prompts sampled at T=0.7")
    sampled_tokens: int = opt(64, "tokens per sampled answer")
    context: int = opt(128, "context tokens before the timed steps")
    cost_steps: int = opt(40, "timed steps")
    threads: int = opt(2, "torch threads")
    json: Path | None = opt(None, "where to write the figures")


@dataclass
class DraftCardOptions(CardOptions):
    """``draft-card``: the default draft's model card figures (specserve/bench/draft_card.py)."""

    draft: str | None = opt(None, "default: the registered default draft")
    sampled_gammas: list[int] = opt([1, 2, 4, 8], "gammas sampled at T=0.7")
    render: Path | None = opt(
        None,
        "measure nothing: write DRAFT_DIR/README.md from DRAFT_DIR/card.json and training_meta.json",
        metavar="DRAFT_DIR",
    )


@dataclass
class HeadCardOptions(CardOptions):
    """``head-card``: the feature head's model card figures (specserve/bench/head_card.py)."""

    head: str | None = opt(None, "a head directory or registered name (default: the default head)")
    gammas: list[int] = opt(HEAD_GAMMAS, "gammas replayed greedily")
    sampled_gammas: list[int] = opt([1, 2, 4], "gammas sampled at T=0.7")
    readme: Path | None = opt(None, "render the model card here")
    curve: list[Path] = opt([], "training runs of the data-size curve", nargs="*")
    from_json: Path | None = opt(None, "render from these figures, measuring nothing")
    tree_nodes: int = opt(
        0,
        "also replay and sample each gamma with the draft's trees (specserve/core/ranked_tree.py) of at most "
        "gamma + this many nodes, and time the target's pass over that many positions (0: chains only)",
    )
    tree_min_path_probability: float = opt(
        0.05, "the path probability a tree's alternative needs (fixed: the card measures the head, not the policy)"
    )

    def __post_init__(self) -> None:
        at_least(self.tree_nodes, 0, "--tree-nodes")
        if not 0.0 <= self.tree_min_path_probability <= 1.0:
            raise ValueError(f"--tree-min-path-probability must be in [0, 1], got {self.tree_min_path_probability}")


@dataclass
class ReportOptions(Options):
    """``report``: render every report in a folder from its JSON again, measuring nothing."""

    folder: Path = opt(DEFAULT_OUT, "the folder (docs/benchmarks)", positional=True)
