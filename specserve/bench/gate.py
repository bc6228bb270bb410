"""``specserve bench gate``: is the stack faster than the target alone, on this machine, today?

Run it before submitting a change to the engine, the workers or the round loop. In a few minutes it
measures, on held-out prompts of seven kinds (chat, code, and the five task kinds of
:mod:`specserve.bench.task_prompts`), greedy, EOS ignored, one stream at a time:

* **HF generate()**: stock transformers, float32, the target alone: what a user runs instead of us, and
  the figure every ratio is against; timed a second time at the other end of each prompt's turn
  (**HF generate(), again**), whose ratio to the first is the machine's A/A noise;
* **HF assisted**: stock ``generate(assistant_model=)`` with the shipped token draft;
* **specserve gamma 0** and **the default request** (nothing set), through a stack of one process per
  role with the settings ``specserve up`` gives them;
* **llama.cpp** on the GGUF the default target is converted from (llama-cpp-python, where it is
  installed): a peer a CPU user might run, with other arithmetic (4-bit weights, 8-bit activations).

Each prompt's turn runs every mode once, the order reversed on every other pass. Every specserve generation
has a cache salt of its own (:func:`own_cache_salt`), so it prefills its whole prompt as HF generate() does:
without it, the target's prefix cache would give every generation after a prompt's first its prompt's KV for
nothing, and the ratio of two modes would depend on which ran first. Per kind, a mode's figure
is the median over (prompt, pass) pairs of its speed over HF generate()'s in the same pair. The gate then
checks the bars of docs/benchmarks/history.md ("The gate's bars") and prints the CPU it ran on; the table
is appended to docs/benchmarks/history.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.bench import markdown as md
from specserve.bench.modes import ADAPTIVE, GAMMA0
from specserve.bench.options import GateOptions
from specserve.bench.pair import hf_generate
from specserve.bench.prompts import load_prompt_sets
from specserve.bench.runner import now_utc, resolve_pair
from specserve.bench.timing import timed_stream
from specserve.engine import kernel_choice
from specserve.engine.kernel_choice import cpu_model_and_flags

HF = "HF generate()"
HF_AGAIN = "HF generate(), again"
HF_ASSISTED = "HF assisted"
GAMMA_0 = "specserve gamma 0"
DEFAULT = "specserve default request"
LLAMA_CPP = "llama.cpp"
#: A prompt's turn, in this order (reversed every other pass); HF again sits at the other end from HF.
ORDER = (HF, HF_ASSISTED, GAMMA_0, DEFAULT, LLAMA_CPP, HF_AGAIN)
KIND_NAMES = {"chat": "chat", "chat-code": "code"}


@dataclass(frozen=True)
class Bar:
    """One bar the gate checks: ``mode``'s speed over ``against``'s is at least ``at_least`` on ``kinds``."""

    mode: str
    against: str
    at_least: float
    kinds: tuple[str, ...]  # () = every kind measured

    def label(self) -> str:
        where = "every kind" if not self.kinds else " and ".join(KIND_NAMES.get(k, k) for k in self.kinds)
        return f"{self.mode} >= {self.at_least:.2f}x {self.against} on {where}"


BARS = (
    Bar(GAMMA_0, HF, 1.0, ("chat", "chat-code")),
    Bar(DEFAULT, HF, 1.15, ("chat",)),
    Bar(DEFAULT, HF, 1.3, ("chat-code",)),
    Bar(DEFAULT, HF_ASSISTED, 1.1, ("chat", "chat-code")),
    Bar(DEFAULT, GAMMA_0, 0.97, ()),
)


@dataclass
class Generation:
    kind: str
    prompt: str
    repeat: int
    mode: str
    tokens: int
    seconds: float
    token_ids: list[int] = field(default_factory=list)
    proposer: str = ""
    #: specserve's own account (GenerationStats): rounds, rounds that drafted, draft tokens proposed and accepted.
    rounds: int = 0
    draft_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    #: Prompt tokens the target took from its prefix cache (0: the whole prompt prefilled, as HF does).
    cached_tokens: int = 0

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / max(self.tokens, 1)


def cpu_kind() -> dict[str, Any]:
    """The CPU the gate ran on: model name, the kernel-relevant flags, cores, torch."""
    name, flags = cpu_model_and_flags()
    return {"cpu": name, "flags": list(flags), "cores": os.cpu_count(), "torch": torch.__version__}


def stock_hf_models(target: str, draft: str) -> tuple[Any, Any, Any]:
    """``(tokenizer, target, draft)`` as stock transformers loads them: float32, its own attention and
    kernels, nothing of this project's (the draft's model class is registered, as it must be to load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specserve.engine.draft_model  # noqa: F401  (registers the default draft's model type)

    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    t = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32).eval()
    d = AutoModelForCausalLM.from_pretrained(draft, local_files_only=True, dtype=torch.float32).eval()
    return tok, t, d


class LlamaCpp:
    """Greedy generation with llama-cpp-python, EOS ignored, on token ids (the GGUF's vocabulary is the
    converted target's)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         logits_all=False, verbose=False)
        self.version = __import__("llama_cpp").__version__

    def generate(self, ids: list[int], max_new: int) -> tuple[list[int], float]:
        start = time.perf_counter()
        out: list[int] = []
        self.llm.reset()
        for token in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == max_new:
                break
        return out, time.perf_counter() - start


def llama_cpp_peer(opts: GateOptions) -> tuple[LlamaCpp | None, str]:
    """The llama.cpp peer, or None with the reason it does not run."""
    from specserve.bench.options import DEFAULT_TARGET
    from specserve.engine import model_registry

    if opts.llama_cpp == "off":
        return None, "off (--llama-cpp off)"
    source = model_registry.REGISTRY.get(DEFAULT_TARGET)
    is_default = Path(opts.target) == Path(model_registry.resolve_model(DEFAULT_TARGET, progress=False))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if opts.llama_cpp == "on":
            raise
        return None, "not installed (pip install llama-cpp-python)"
    if not is_default or not isinstance(source, model_registry.IndexGGUF):
        return None, "the target is not the default one, whose GGUF llama.cpp runs"
    return LlamaCpp(source.gguf_file(progress=True), opts.threads), "ran"


def _ratios(gens: list[Generation], mode: str, against: str, kind: str) -> list[float]:
    """``against``'s ms/token over ``mode``'s (a speed ratio) in each (prompt, pass) pair of ``kind``."""
    by = {(g.prompt, g.repeat, g.mode): g.ms_per_token for g in gens if g.kind == kind}
    return [by[p, r, against] / ms for (p, r, m), ms in by.items() if m == mode and (p, r, against) in by]


def summarize(gens: list[Generation], kinds: list[str]) -> dict[str, Any]:
    """Per kind and mode: median ms/token, the median (min, max) speed over HF, over gamma 0 and over HF
    assisted; the A/A noise; greedy identity of the specserve modes with HF; the bars."""
    table: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        rows: dict[str, Any] = {}
        for mode in ORDER:
            ms = [g.ms_per_token for g in gens if g.kind == kind and g.mode == mode]
            if not ms:
                continue
            row: dict[str, Any] = {"ms_per_token": statistics.median(ms), "n": len(ms)}
            for against, name in ((HF, "vs_hf"), (GAMMA_0, "vs_gamma0"), (HF_ASSISTED, "vs_assisted")):
                r = _ratios(gens, mode, against, kind)
                if r:
                    row[name] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
            rows[mode] = row
        table[kind] = rows
    identity = {}
    for mode in (GAMMA_0, DEFAULT):
        ref = {(g.kind, g.prompt, g.repeat): g.token_ids for g in gens if g.mode == HF}
        mine = [(g.token_ids == ref.get((g.kind, g.prompt, g.repeat))) for g in gens if g.mode == mode]
        identity[mode] = {"identical": sum(mine), "of": len(mine)}
    bars = []
    for bar in BARS:
        for kind in bar.kinds or tuple(kinds):
            if kind not in table or bar.mode not in table[kind]:
                continue
            key = {HF: "vs_hf", GAMMA_0: "vs_gamma0", HF_ASSISTED: "vs_assisted"}[bar.against]
            got = table[kind][bar.mode].get(key, {}).get("median")
            if got is not None:
                bars.append({"bar": bar.label(), "kind": kind, "measured": got, "met": got >= bar.at_least})
    proposers = sorted({g.proposer for g in gens if g.mode == DEFAULT and g.proposer})
    return {"table": table, "greedy_identity": identity, "bars": bars, "default_proposers": proposers}


def render(data: dict[str, Any]) -> str:
    """The gate's Markdown: the CPU, the command, the table, the bars."""
    cpu = data["cpu_kind"]
    summary = data["summary"]
    lines = [
        f"### Speed gate, {data['date_utc']} UTC, {cpu['cpu']}",
        "",
        f"CPU: {cpu['cpu']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or '-'}; torch {cpu['torch']}; "
        f"load average {data['load_average']['before'][0]:.2f} before, {data['load_average']['after'][0]:.2f} after.",
        "",
        "```",
        data["command"],
        "```",
        "",
        f"{data['settings']['max_new_tokens']} tokens per generation, greedy, EOS ignored; {data['settings']['repeats']} "
        "interleaved passes. Cells: median ms/token, then the median (min-max over prompts and passes) speed over "
        "HF generate() in the same turn. The default request drafted with: "
        f"{', '.join(summary['default_proposers']) or '-'}. llama.cpp: {data['llama_cpp']}.",
        "Kernel paths the stack's workers run (recorded for this kind of machine; ms each path took when timed): "
        + ("; ".join(f"{k['role']} {k['kernels']} ("
                     + ", ".join(f"{p} {ms:.1f}" for p, ms in sorted(k['timings_ms'].items())) + ")"
                     for k in sorted(data.get("kernels", []), key=lambda k: k["role"])) or "-") + ".",
        "",
    ]
    kinds = list(summary["table"])
    header = ["mode", *(KIND_NAMES.get(k, k) for k in kinds)]
    rows = []
    for mode in ORDER:
        cells = [mode]
        for kind in kinds:
            row = summary["table"][kind].get(mode)
            if row is None:
                cells.append("-")
                continue
            vs = row.get("vs_hf")
            ratio = "" if vs is None else f" ({vs['median']:.2f}x, {vs['min']:.2f}-{vs['max']:.2f})"
            cells.append(f"{row['ms_per_token']:.1f}{ratio}")
        rows.append(cells)
    lines += md.table(header, rows)
    vs_g0 = [f"{KIND_NAMES.get(k, k)} {summary['table'][k][DEFAULT]['vs_gamma0']['median']:.2f}x"
             for k in kinds if DEFAULT in summary["table"][k] and "vs_gamma0" in summary["table"][k][DEFAULT]]
    lines += ["", f"The default request over gamma 0 (median per kind): {', '.join(vs_g0)}."]
    ident = summary["greedy_identity"]
    lines += ["Greedy output identical to HF generate(): " + "; ".join(
        f"{m} {v['identical']} of {v['of']}" for m, v in ident.items()) + "."]
    lines += ["", "Bars:", ""]
    for b in summary["bars"]:
        lines.append(f"- {'met' if b['met'] else '**missed**'}: {b['bar']} ({KIND_NAMES.get(b['kind'], b['kind'])}: "
                     f"{b['measured']:.2f}x)")
    return "\n".join(lines) + "\n"


def _prompts(opts: GateOptions, tokenizer: Any) -> dict[str, list[tuple[str, list[int]]]]:
    out = {}
    for kind in opts.kinds:
        n = opts.prompts if kind in ("chat", "chat-code", "copy", "code", "prose") else opts.task_prompts
        out.update(load_prompt_sets([kind], tokenizer, Path(opts.target), n, 600))
    return out


async def measure(opts: GateOptions) -> dict[str, Any]:
    from specserve.client import AsyncClient
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import private_redis

    torch.set_num_threads(opts.threads)
    tokenizer, target, draft = stock_hf_models(opts.target, opts.draft)
    prompts = _prompts(opts, tokenizer)
    llama, llama_note = llama_cpp_peer(opts)
    overrides = opts.overrides()
    gens: list[Generation] = []
    with private_redis(opts.redis_url) as url:
        stack = await start_process_stack(
            target_model=opts.target, draft_model=opts.draft, redis_url=url,
            target_overrides=overrides["target"], draft_overrides=overrides["draft"],
            coordinator_overrides=overrides["coordinator"],
        )  # fmt: skip
        kernels = [{"role": c.role, "kernels": c.kernels, "timings_ms": c.timings_ms, "kind": c.kind}
                   for c in kernel_choice.recorded(url)]
        try:
            async with AsyncClient(stack.address) as client:
                runners = {
                    HF: lambda ids: hf_generate(target, ids, opts.max_new_tokens),
                    HF_AGAIN: lambda ids: hf_generate(target, ids, opts.max_new_tokens),
                    HF_ASSISTED: lambda ids: hf_generate(target, ids, opts.max_new_tokens, assistant_model=draft),
                }
                if llama is not None:
                    runners[LLAMA_CPP] = lambda ids: llama.generate(ids, opts.max_new_tokens)

                async def one(mode: str, ids: list[int]) -> tuple[list[int], float, dict[str, Any]]:
                    if mode in runners:
                        new, seconds = runners[mode](ids)
                        return new, seconds, {}
                    spec = GAMMA0 if mode == GAMMA_0 else ADAPTIVE  # ADAPTIVE sets nothing: the default
                    stream = client.stream(prompt_token_ids=ids, max_new_tokens=opts.max_new_tokens, temperature=0.0,
                                           seed=opts.seed, ignore_eos=True, cache_salt=own_cache_salt(mode),
                                           **spec.request())
                    streamed = await timed_stream(stream)
                    st = streamed.stats
                    return streamed.token_ids, streamed.seconds, {
                        "proposer": st.proposer, "rounds": st.rounds, "draft_rounds": st.draft_rounds,
                        "proposed": st.proposed_tokens, "accepted": st.accepted_tokens,
                        "cached_tokens": st.cached_tokens,
                    }

                modes = [m for m in ORDER if m in runners or m in (GAMMA_0, DEFAULT)]
                gens += await interleaved_turns(prompts, modes, opts.repeats, one, Generation, desc="speed gate")
        finally:
            await stack.stop()
    return {
        "gens": gens,
        "kernels": kernels,
        "llama_cpp": llama_note if llama is None else f"llama-cpp-python {llama.version}, {opts.threads} threads",
    }


_SALTS = itertools.count()


def own_cache_salt(mode: str) -> str:
    """A cache salt no other generation of this process has (``GenerateRequest.cache_salt``): the generation
    finds none of the prefix cache's blocks of another, so it prefills its whole prompt, as HF generate() does
    (module docstring)."""
    return f"bench/{mode}/{next(_SALTS)}"


async def interleaved_turns(
    prompts: dict[str, list[tuple[str, list[int]]]],
    modes: list[str],
    repeats: int,
    one: Callable[[str, list[int]], Awaitable[tuple[list[int], float, dict[str, Any]]]],
    generation: Callable[..., Generation],
    *,
    desc: str,
) -> list[Generation]:
    """Every mode once on a short warm-up, then ``repeats`` passes over the prompts, each prompt's turn running
    every mode in order (reversed every other pass); ``one(mode, ids)`` runs a generation, ``generation`` records
    it (a :class:`Generation` or a subclass, with ``one``'s stats as keywords)."""
    warm = next(iter(prompts.values()))[0][1]
    for mode in modes:  # each path once before anything is timed
        await one(mode, warm[:32])
    jobs = [(k, name, ids) for k, ps in prompts.items() for name, ids in ps]
    gens = []
    with tqdm(total=repeats * len(jobs) * len(modes), desc=desc, unit="gen") as bar:
        for repeat in range(repeats):
            for kind, name, ids in jobs:
                for mode in modes if repeat % 2 == 0 else modes[::-1]:
                    new, seconds, stats = await one(mode, ids)
                    gens.append(generation(kind, name, repeat, mode, len(new), seconds, new, **stats))
                    bar.update()
    return gens


def main(opts: GateOptions) -> int:
    from specserve.runtime.logs import configure_logging

    resolve_pair(opts)
    configure_logging("console", "warning")
    cpu = cpu_kind()
    print(f"speed gate on {cpu['cpu']} ({cpu['cores']} cores; {' '.join(cpu['flags'])}), torch {cpu['torch']}",
          flush=True)
    before = os.getloadavg()
    measured = asyncio.run(measure(opts))
    gens: list[Generation] = measured["gens"]
    data = {
        "command": opts.command,
        "date_utc": now_utc(),
        "cpu_kind": cpu,
        "lscpu_model": _lscpu_model(),
        "settings": opts.settings(),
        "llama_cpp": measured["llama_cpp"],
        "kernels": measured["kernels"],
        "load_average": {"before": list(before), "after": list(os.getloadavg())},
        "summary": summarize(gens, list(opts.kinds)),
        "generations": [{k: v for k, v in asdict(g).items() if k != "token_ids"} for g in gens],
    }
    text = render(data)
    print("\n" + text)
    raw = md.write_json(opts.out / "gate.json", data)
    (opts.out / "gate.md").write_text("# The speed gate, last run\n\n" + text)
    if opts.history is not None and not opts.no_history:
        with opts.history.open("a") as f:
            f.write("\n" + text)
    print(f"wrote {raw}, {opts.out / 'gate.md'}" + ("" if opts.no_history else f" and appended to {opts.history}"))
    return 0


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
