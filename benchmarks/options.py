"""The options of each experiment under ``python -m benchmarks``: typed dataclasses built the way the
product benchmark's are (:mod:`specserve.bench.options`: a field is an option, ``opt()`` gives its default
and help, ``__post_init__`` refuses what no run can do with a ``ValueError`` naming the option). What each
experiment measures is in its module's docstring and its report in docs/benchmarks.
"""

# ruff: noqa: RUF009  (every default below is opt(), which returns a dataclasses.field)
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specserve.bench.options import (
    DEFAULT_DRAFT,
    DEFAULT_OUT,
    DEFAULT_TARGET,
    GATE_KINDS,
    HEAD_HELP,
    PROMPT_SETS,
    GateOptions,
    Kernels,
    Options,
    PairOptions,
    PromptOptions,
    at_least,
    opt,
)

#: The sampling-mode comparison's temperatures and gamma settings ("auto": the adaptive policy).
SAMPLING_TEMPERATURES = (0.7, 1.0)
SAMPLING_GAMMAS = ("auto", "4")


@dataclass
class DraftScalingOptions(PairOptions):
    """``draft-scaling``: 1..32 concurrent sessions with the draft's batching on and off, into
    draft_scaling.json, .md and .png (benchmarks/draft_scaling.py)."""

    prompt_chars: int = opt(600, "characters of each prompt (code)")
    sessions: list[int] = opt([1, 2, 4, 8, 16, 32], "concurrent sessions")
    gamma: int = opt(4, "the fixed gamma")
    max_new_tokens: int = opt(48, "tokens per generation")
    repeats: int = opt(1, "runs per point")
    draft_batch: int = opt(32, "sessions the draft drafts per pass with batching on")

    def __post_init__(self) -> None:
        at_least(self.draft_batch, 2, "--draft-batch")


@dataclass
class SamplingModesOptions(PromptOptions):
    """``sampling-modes``: the coupled sampling mode against the optimal one, into sampling_modes.json and
    sampling_modes.md (benchmarks/sampling_modes.py)."""

    prompts: int = opt(8, "prompts per set")
    temperatures: list[float] = opt(SAMPLING_TEMPERATURES, "temperatures")
    gammas: list[str] = opt(SAMPLING_GAMMAS, "'auto' (adaptive) or integers")
    max_new_tokens: int = opt(128, "tokens per generation")

    def __post_init__(self) -> None:
        super().__post_init__()
        for g in self.gammas:
            if g != "auto" and not g.isdigit():
                raise ValueError(f"--gammas takes 'auto' or integers >= 0, got {g!r}")


@dataclass
class PredictionOptions(PairOptions):
    """``prediction``: Predicted Outputs against gamma 0, into prediction.json and prediction.md
    (benchmarks/prediction.py)."""

    prompts: int = opt(4, "held-out code prompts")
    prompt_chars: int = opt(600, "characters of each prompt (code)")
    max_new_tokens: int = opt(128, "tokens per generation")
    block: int = opt(16, "half-wrong: every other block of this many tokens")
    repeats: int = opt(1, "runs per prompt and mode")


@dataclass
class OverheadOptions(Options):
    """``overhead``: gamma 0 through the whole system against HF generate() (benchmarks/overhead.py)."""

    target: str | None = opt(None, "registered name or directory (default: the default target)")
    prompts: int = opt(6, "held-out chat prompts")
    repeats: int = opt(1, "passes over the prompts")
    max_new_tokens: int = opt(64, "tokens per generation")
    threads: int = opt(2, "torch threads, here and in the target process")
    redis_url: str | None = opt(None, "default: a private redis-server")
    kernels: Kernels = opt("fastest", "the target's linear kernels, in the service and in HF alike")
    decode_steps: list[int] = opt([1, 4], "the coordinator's decode_steps for each stack measured")
    temperature: float = opt(0.0, "0: greedy; above 0: HF and specserve both sample at this temperature")
    json: Path | None = opt(None, "where to write the figures (overhead.json; the report renders its section)")


@dataclass
class PassOptions(Options):
    """A benchmark of two copies of the target: passes over 1..--max-k positions, then greedy output."""

    target: str = opt(DEFAULT_TARGET, "a registered model name or a directory")
    max_k: int = opt(9, "the longest pass, in positions")
    prompts: int = opt(6, "held-out prompts per kind (chat, code)")
    max_new_tokens: int = opt(64, "tokens per greedy output")
    threads: int | None = opt(None, "torch threads (default: torch's)")
    out: Path = opt(DEFAULT_OUT, "the folder the JSON and the Markdown go to")


@dataclass
class KernelsOptions(PassOptions):
    """``kernels``: stock against packed oneDNN linear kernels (benchmarks/kernels.py)."""

    draft: str = opt(DEFAULT_DRAFT, "a registered model name or a directory")
    draft_gamma: int = opt(4, "tokens per proposal in the draft's timing")
    rounds: int = opt(5, "rounds of timings")
    repeats: int = opt(5, "timings per round")


@dataclass
class InvarianceOptions(Options):
    """``invariance``: what the row-invariant target passes cost (benchmarks/invariance.py)."""

    target: str = opt(DEFAULT_TARGET, "a registered model name or a directory")
    kernels: list[Literal["stock", "onednn"]] = opt(["stock", "onednn"], "the linear kernels, each measured")
    contexts: list[int] = opt([128, 512], "context lengths before the timed pass")
    ks: list[int] = opt([5], "verify pass widths timed besides k = 1", nargs="*")
    pairs: int = opt(30, "pairs of timings (one pass of each copy) per k")
    prefills: list[int] = opt([128, 512], "prompt lengths prefilled", nargs="*")
    prefill_pairs: int = opt(5, "pairs of timings per prefill length")
    prompts: int = opt(3, "held-out prompts per kind (chat, code); 0: none")
    max_new_tokens: int = opt(64, "tokens per greedy output")
    clock: Literal["cpu", "wall"] = opt(
        "cpu",
        "cpu: the model thread's CPU time, with --threads 1 (what a pass costs, little moved by other processes "
        "on a shared machine); wall: elapsed time",
    )
    threads: int = opt(1, "torch threads")
    out: Path = opt(DEFAULT_OUT, "the folder the JSON and the Markdown go to")

    def __post_init__(self) -> None:
        if self.clock == "cpu" and self.threads != 1:
            raise ValueError("--clock cpu measures one thread: use --threads 1")


@dataclass
class AttentionOptions(PassOptions):
    """``attention``: transformers' SDPA against grouped heads read in place (benchmarks/attention.py)."""

    kernels: Literal["stock", "onednn"] = opt("onednn", "the linear kernels of both copies")
    contexts: list[int] = opt([128, 512], "context lengths before the timed pass")
    pairs: int = opt(30, "pairs of timings (one pass of each copy) per k")
    prompts: int = opt(3, "held-out prompts per kind (chat, code)")
    max_new_tokens: int = opt(48, "tokens per greedy output")


@dataclass
class DemoPairOptions(Options):
    """``demo-pair``: the embedded demo pair's acceptance and costs (benchmarks/demo_pair.py)."""

    target: str = opt("models/specserve-demo-target", "the target's directory")
    draft: str = opt("models/specserve-demo-draft", "the draft's directory")
    gamma: int = opt(4, "the fixed gamma")
    prompts: int = opt(16, "held-out prompts for (a)")
    prompt_len: int = opt(96, "prompt tokens")
    max_new: int = opt(96, "tokens per generation")
    windows: int = opt(32, "held-out windows for (b), (c)")
    window_len: int = opt(256, "tokens per window")
    steps: int = opt(200, "timed decode steps for (d)")
    warmup: int = opt(30, "untimed steps before them")
    context: int = opt(128, "KV cache length before timing (d)")
    threads: int = opt(2, "torch threads")
    json: Path = opt(Path("demo_pair_bench.json"), "where to write the JSON results")


@dataclass
class ConstraintsOptions(Options):
    """``constraints``: the constraint engines, xgrammar and llguidance, compared on the validity set
    (benchmarks/constraints.py)."""

    target: str = opt(DEFAULT_TARGET, "whose tokenizer (a registered name or a directory)")
    vocab_size: int = opt(0, "the mask's width (0: the tokenizer's length)")
    set: Path = opt(Path("tests/data/constraints"), "the validity set's directory")
    repeats: int = opt(5, "cold compiles and example passes per constraint")
    walks: int = opt(20, "uniform walks under the mask per constraint")
    byte_walks: int = opt(20, "walks among the allowed single-byte tokens per constraint")
    max_walk: int = opt(256, "tokens at most per walk")
    threads: int = opt(2, "xgrammar compiler threads")
    seed: int = opt(0, "the walks' seed")
    out: Path | None = opt(None, "write constraint_engines.json/.md here")


#: greedy-identity's configurations: name -> (requests at a time, gamma; None: the automatic policy).
GREEDY_CONFIGS: dict[str, tuple[int, int | None]] = {
    "batched": (8, None),
    "gamma4": (8, 4),
    "gamma1": (8, 1),
    "gamma0": (8, 0),
    "alone": (1, None),
}


@dataclass
class GreedyIdentityOptions(Options):
    """``greedy-identity``: greedy output through the whole system against stock HF generate(), prompt by
    prompt (benchmarks/greedy_identity.py)."""

    n: int = opt(200, "held-out prompts")
    max_new_tokens: int = opt(32, "tokens per reply")
    configs: list[str] = opt(list(GREEDY_CONFIGS), "the configurations", choices=list(GREEDY_CONFIGS))
    target: str = opt(DEFAULT_TARGET, "a registered model name or a directory")
    draft: str = opt(DEFAULT_DRAFT, "a registered model name or a directory")
    out: Path = opt(Path("greedy-identity-out"), "the folder greedy_identity.json and .md go to")
    only: list[str] = opt([], "run only these of the --n prompts, by name (a recheck of some)")
    proposer: str = opt("model", "the requests' proposer: the token draft, or the feature head (its trees)",
                        choices=["model", "feature"])


@dataclass
class PrefixCacheOptions(Options):
    """``prefix-cache``: time to first token per turn of greedy chats with the prefix cache on and off
    (benchmarks/prefix_cache.py)."""

    out: Path = opt(DEFAULT_OUT, "the folder prefix_cache.json, prefix-cache.md and the plot go to")
    repeats: int = opt(2, "conversations per stack")
    turns: int = opt(6, "turns per conversation")
    answer_tokens: int = opt(150, "tokens of each answer (EOS ignored)")
    user_tokens: int = opt(70, "tokens of each user message, about")
    redis_url: str | None = opt(None, "a Redis to use (default: a throw-away one)")
    start_timeout_s: float = opt(1200.0, "longest a stack may take to start")


@dataclass
class PrefixCacheMemoryOptions(Options):
    """``prefix-cache-memory``: many distinct prefixes through one KV-cache store with a budget for a few of
    them (benchmarks/prefix_cache.py)."""

    out: Path = opt(DEFAULT_OUT, "the folder prefix_cache_memory.json goes to (prefix-cache.md is rendered again)")
    prefixes: int = opt(1000, "distinct prompts")
    tokens: int = opt(1000, "tokens per prompt")
    keep: int = opt(100, "prompts the store's budget holds")
    memory_model: str = opt("tiny", "'tiny' (a 2-layer Llama from a config) or a model name or directory")


@dataclass
class StructuredOptions(Options):
    """``structured``: structured output under speculation through the service: the default request against
    target-alone constrained decoding (gamma 0) on JSON schemas with long fixed keys, ordinary streams'
    inter-token latency beside schemas that take seconds to compile, and beside one client flooding slow
    schemas while another's is served (benchmarks/structured.py, structured_flood.py)."""

    out: Path = opt(DEFAULT_OUT, "the folder <name>.json and <name>.md go to")
    name: str = opt("structured", "the files' name")
    target: str | None = opt(None, "a registered model name or a directory (default: the default target)")
    draft: str | None = opt(None, "a registered model name or a directory (default: the default draft)")
    parts: list[Literal["speed", "isolation", "flood"]] = opt(["speed", "isolation", "flood"], "the parts to run")
    schemas: Path = opt(Path("tests/data/constraints/long_keys.json"), "the speed part's schemas (name, prompt, schema)")
    limit: int = opt(0, "the first N schemas only (0: all)")
    repeats: int = opt(3, "interleaved pairs (gamma 0, the default request) per schema")
    max_new_tokens: int = opt(320, "tokens at most per constrained generation (each stops where its schema is complete)")
    streams: int = opt(8, "ordinary streams at once in the isolation part")
    stream_tokens: int = opt(96, "tokens per ordinary stream (EOS ignored)")
    slow_requests: int = opt(3, "slow-compiling requests sent beside the streams, each schema distinct")
    slow_patterns: int = opt(280, "patternProperties per slow schema (compile time grows about as its cube)")
    slow_tokens: int = opt(8, "tokens at most per slow request")
    isolation_repeats: int = opt(2, "times each condition (alone, beside) runs, in ABBA order")
    flood_requests: int = opt(8, "the flooding client's requests in flight, each a new slow schema")
    flood_patterns: int = opt(
        400, "patternProperties per flooding schema (past the coordinator's compile limit: refused, compiling on)"
    )
    flood_repeats: int = opt(2, "times each condition (alone, beside a flood) runs, in ABBA order")
    target_threads: int = opt(
        0,
        "the target's torch threads (0: its default, one per core; 1 keeps a pass's cost steady on a machine "
        "whose cores other processes share, where a second thread team waits on descheduled threads)",
    )
    redis_url: str | None = opt(None, "a Redis to use (default: a throw-away one)")
    start_timeout_s: float = opt(1200.0, "longest the stack may take to start")

    def __post_init__(self) -> None:
        at_least(self.repeats, 1, "--repeats")
        at_least(self.streams, 1, "--streams")
        at_least(self.stream_tokens, 2, "--stream-tokens")
        at_least(self.slow_requests, 1, "--slow-requests")
        at_least(self.slow_patterns, 1, "--slow-patterns")
        at_least(self.isolation_repeats, 1, "--isolation-repeats")
        at_least(self.flood_requests, 1, "--flood-requests")
        at_least(self.flood_repeats, 1, "--flood-repeats")
        for flag, value in (("--slow-patterns", self.slow_patterns), ("--flood-patterns", self.flood_patterns)):
            if not 1 <= value <= 26 * 26:
                raise ValueError(f"{flag} must be 1..{26 * 26}, got {value}")




@dataclass
class CoupledListsOptions(Options):
    """``coupled-lists``: how often a list of K siblings holds the coupled mode's token, for each way of
    listing them, on the feature head's own (p, q) pairs, into coupled_lists.json and coupled_lists.md
    (benchmarks/coupled_lists.py)."""

    target: str | None = opt(None, "default: the registered default target")
    head: str | None = opt(None, "a head directory or registered name (default: the default head)")
    sets: list[str] = opt(["chat", "code"], "held-out chat conversations (the head card's sets)", choices=["chat", "code"])
    prompts: int = opt(12, "held-out prompts per set")
    tokens: int = opt(48, "tokens the target samples per prompt (one (p, q) pair each)")
    temperature: float = opt(0.7, "the sampling temperature")
    sizes: list[int] = opt([1, 2, 4], "list sizes K")
    draws: int = opt(100, "noise draws per pair")
    seed: int = opt(0, "the seed of the noise draws")
    threads: int = opt(2, "torch threads")
    out: Path = opt(DEFAULT_OUT, "the folder the JSON and the Markdown go to")

    def __post_init__(self) -> None:
        at_least(self.prompts, 1, "--prompts")
        at_least(self.tokens, 1, "--tokens")
        at_least(self.draws, 1, "--draws")
        for k in self.sizes:
            at_least(k, 1, "--sizes")
        if not self.temperature > 0.0:
            raise ValueError(f"--temperature must be > 0 (the coupled mode samples), got {self.temperature}")


BUDGETS_HELP = (
    "tree budgets, each ALTERNATIVES:THRESHOLD (at most gamma + ALTERNATIVES nodes, a node only at a path "
    "probability of THRESHOLD or more)"
)


@dataclass
class TreeExpansionOptions(Options):
    """``tree-expansion``: the feature head's trees with and without EAGLE-2's expansion below the alternatives,
    on the head card's held-out greedy rounds, into tree_expansion.json and tree_expansion.md
    (benchmarks/tree_expansion.py)."""

    target: str | None = opt(None, "default: the registered default target")
    head: str | None = opt(None, "a head directory or registered name (default: the default head)")
    sets: list[str] = opt(["chat", "code"], "held-out sets (the head card's)", choices=["chat", "code"])
    prompts: int = opt(16, "held-out prompts per set")
    max_new_tokens: int = opt(96, "tokens of the target's greedy answer replayed per prompt")
    gamma: int = opt(4, "the chain's length (the tree's depth)")
    budgets: list[str] = opt(["8:0.05", "16:0.02"], BUDGETS_HELP)
    threads: int = opt(2, "torch threads")
    out: Path = opt(DEFAULT_OUT, "the folder the JSON and the Markdown go to")

    def __post_init__(self) -> None:
        at_least(self.prompts, 1, "--prompts")
        at_least(self.max_new_tokens, 2, "--max-new-tokens")
        at_least(self.gamma, 1, "--gamma")
        for budget in self.budgets:
            parse_budget(budget)


@dataclass
class TreeSamplingOptions(TreeExpansionOptions):
    """``tree-sampling``: the feature head's trees in sampled rounds (the optimal rule), the chain drawn from the
    head's q against every node a ranked point mass, at each budget, into tree_sampling.json and
    tree_sampling.md (benchmarks/tree_sampling.py)."""

    prompts: int = opt(8, "held-out prompts per set")
    seeds: int = opt(2, "seeded generations per prompt")
    max_new_tokens: int = opt(48, "tokens generated per generation")
    temperature: float = opt(0.7, "the sampling temperature, the target's and the drawn chain's")
    budgets: list[str] = opt(["16:0.02", "32:0.01"], BUDGETS_HELP)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.seeds, 1, "--seeds")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be above 0 (greedy trees: tree-expansion); got {self.temperature}")


def parse_budget(text: str) -> tuple[int, float]:
    """``ALTERNATIVES:THRESHOLD`` -> ``(alternatives, threshold)``, or ValueError naming the flag."""
    try:
        nodes, threshold = text.split(":")
        return int(nodes), float(threshold)
    except ValueError:
        raise ValueError(f"--budgets takes ALTERNATIVES:THRESHOLD, such as 8:0.05; got {text!r}") from None


@dataclass
class TreesOptions(PairOptions):
    """``trees``: the feature head drafting trees (the default request) against the same head drafting chains
    (``draft_tree_nodes=0``), with HF generate() at both ends of each turn, on the speed gate's held-out kinds,
    into trees.json and trees.md (benchmarks/trees.py)."""

    kinds: list[str] = opt(list(GATE_KINDS), "held-out kinds", choices=PROMPT_SETS)
    prompts: int = opt(2, "prompts per kind for chat and chat-code")
    task_prompts: int = opt(2, "prompts per kind for the five task kinds")
    max_new_tokens: int = opt(64, "tokens per generation (EOS ignored)")
    repeats: int = opt(2, "passes over the prompts, every other one with the modes in the reverse order")
    threads: int = opt(2, "torch threads of HF generate() (the target service takes the machine's cores)")
    head: str = opt("auto", HEAD_HELP)
    gamma: int | None = opt(None, "a fixed gamma in both arms' requests (default: the adaptive policy's)")
    setting: list[str] = opt([], "ROLE.KEY=VALUE settings of the stack, both coordinators alike (e.g. "
                             "coordinator.draft_tree_min_path_probability=0.05)", nargs="*")
    start_timeout_s: float = opt(600.0, "longest each process of the stack may take to start")

    def __post_init__(self) -> None:
        at_least(self.prompts, 1, "--prompts")
        at_least(self.task_prompts, 1, "--task-prompts")
        at_least(self.max_new_tokens, 2, "--max-new-tokens")
        at_least(self.repeats, 1, "--repeats")
        at_least(self.threads, 1, "--threads")
        if self.gamma is not None:
            at_least(self.gamma, 0, "--gamma")
        self.overrides()  # --setting checked

    def overrides(self) -> dict[str, dict[str, object]]:
        """``--setting`` by role, as the speed gate reads it (:meth:`GateOptions.overrides`)."""
        return GateOptions(setting=self.setting).overrides()


@dataclass
class TreeVerifyOptions(Options):
    """``tree-verify``: a lone session's tree verify pass in a padded batch of one against its own cache, into
    tree_verify.json and tree_verify.md (benchmarks/tree_verify.py)."""

    target: str = opt(DEFAULT_TARGET, "a registered model name or a directory")
    kernels: list[Literal["stock", "onednn"]] = opt(["stock", "onednn"], "the linear kernels, each measured")
    contexts: list[int] = opt([128, 512], "cached tokens before the timed passes")
    nodes: list[int] = opt([4, 8, 16], "tree sizes (nodes after the pending token)")
    pairs: int = opt(15, "interleaved rounds timed per setting")
    threads: int = opt(2, "torch threads")
    out: Path = opt(DEFAULT_OUT, "the folder the JSON and the Markdown go to")

    def __post_init__(self) -> None:
        at_least(self.pairs, 1, "--pairs")
        for n in self.nodes:
            at_least(n, 1, "--nodes")
        for c in self.contexts:
            at_least(c, 1, "--contexts")
