"""The benchmark harness: every figure of the report from one run on one machine.

``python -m bench.harness`` (or ``specserve bench``) measures, side by side:

1. **Single stream** on code and prose prompts, greedy and temperature 1:
   Hugging Face ``generate()`` of the target alone, Hugging Face assisted
   generation (``assistant_model=`` the draft), and specserve through the whole
   gRPC path with gamma = 0, fixed gamma in {1, 2, 4, 8}, the n-gram proposer
   and the adaptive policy. Wall-clock per committed token, time to first token.
2. **Under load**: open-loop Poisson arrivals at several rates for gamma = 0,
   the best fixed gamma and adaptive: throughput, TTFT and inter-token latency
   p50/p99, queue delay, target forward passes and positions (the accelerator
   work), accepted tokens and wasted proposals.
3. **The bound**: the cost model's predicted speedup per gamma from the
   measured acceptance and measured draft / verify costs, and measured /
   predicted as the implementation's efficiency.

Raw figures go to ``<out>/bench.json``; ``bench.report`` renders the Markdown
report and the PNG plots from that file.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.costs import measure_costs
from bench.prompts import Prompt, code_prompts, heldout_files, prose_prompts

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = ROOT / "models" / "specserve-demo-target"
DEFAULT_DRAFT = ROOT / "models" / "specserve-demo-draft"

#: specserve modes: name -> (gamma or None for adaptive, proposer)
SPEC_MODES: dict[str, tuple[int | None, str]] = {
    "specserve gamma=0": (0, "model"),
    "specserve gamma=1": (1, "model"),
    "specserve gamma=2": (2, "model"),
    "specserve gamma=4": (4, "model"),
    "specserve gamma=8": (8, "model"),
    "specserve n-gram gamma=4": (4, "ngram"),
    "specserve adaptive": (None, "model"),
}
FIXED_GAMMAS = (1, 2, 4, 8)


@dataclass
class Run:
    """One generation of one prompt in one mode."""

    mode: str
    prompt_set: str
    prompt: str
    temperature: float
    tokens: int
    total_s: float
    first_token_s: float
    queue_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.total_s / max(self.tokens, 1)


# --------------------------------------------------------------------------- Hugging Face baselines


def _hf_generate(
    model, ids: torch.Tensor, max_new: int, temperature: float, seed: int, assistant=None
) -> Run:
    kwargs = {
        "max_new_tokens": max_new,
        "min_new_tokens": max_new,  # same token count as specserve's ignore_eos runs
        "do_sample": temperature > 0,
        "pad_token_id": model.config.eos_token_id,
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    total = time.perf_counter() - start
    new = out[0, ids.shape[1] :].tolist()
    return Run("", "", "", temperature, len(new), total, float("nan"), token_ids=new)


# --------------------------------------------------------------------------- specserve through gRPC


async def _spec_generate(
    client, ids: list[int], max_new: int, temperature: float, seed: int, gamma: int | None, proposer: str
) -> tuple[Run, list[tuple[float, int]]]:
    """One streamed generation; returns the run and (arrival time, size) of each chunk."""
    stream = client.stream(
        prompt_token_ids=ids,
        max_new_tokens=max_new,
        temperature=temperature,
        seed=seed,
        ignore_eos=True,
        gamma=gamma,
        proposer=proposer,
    )
    start = time.perf_counter()
    stamps: list[tuple[float, int]] = []  # (arrival time, tokens in the chunk)
    tokens: list[int] = []
    async for chunk in stream:
        if chunk.token_ids:
            stamps.append((time.perf_counter() - start, len(chunk.token_ids)))
            tokens.extend(chunk.token_ids)
    total = time.perf_counter() - start
    stats = stream.stats
    run = Run(
        "",
        "",
        "",
        temperature,
        len(tokens),
        total,
        stamps[0][0] if stamps else float("nan"),
        queue_s=stats.queue_ns / 1e9,
        proposed=stats.proposed_tokens,
        accepted=stats.accepted_tokens,
        rounds=stats.rounds,
        accepted_per_position=list(stats.accepted_per_position),
        token_ids=tokens,
    )
    return run, stamps


# --------------------------------------------------------------------------- phases


async def single_stream(
    client, target, draft, tokenizer, prompts: dict[str, list[Prompt]], temperatures, max_new: int, seed: int
) -> list[Run]:
    runs: list[Run] = []
    jobs = [(s, p, t) for s, ps in prompts.items() for p in ps for t in temperatures]
    modes = ["hf target-only", "hf assisted", *SPEC_MODES]
    bar = tqdm(total=len(jobs) * len(modes), desc="single stream", unit="gen")
    for set_name, prompt, temp in jobs:
        ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        for mode in modes:
            if mode == "hf target-only":
                run = _hf_generate(target, ids, max_new, temp, seed)
            elif mode == "hf assisted":
                run = _hf_generate(target, ids, max_new, temp, seed, assistant=draft)
            else:
                gamma, proposer = SPEC_MODES[mode]
                run, _ = await _spec_generate(client, ids[0].tolist(), max_new, temp, seed, gamma, proposer)
            run.mode, run.prompt_set, run.prompt = mode, set_name, prompt.name
            runs.append(run)
            bar.update()
    bar.close()
    return runs


@dataclass
class LoadPoint:
    mode: str
    rate_rps: float
    requests: int
    completed: int
    errors: int
    duration_s: float
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    queue_p50_s: float
    committed_tokens: int
    proposed_tokens: int
    accepted_tokens: int
    wasted_tokens: int
    target_positions: int
    target_forward_passes: int


def _metric(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


async def load_point(
    client,
    prompts: list[list[int]],
    rate: float,
    duration_s: float,
    max_new: int,
    temperature: float,
    gamma: int | None,
    mode: str,
    seed: int,
) -> LoadPoint:
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration_s:
            break
        arrivals.append(t)
    positions0 = _metric("specserve_target_positions_processed_total")
    passes0 = _metric("specserve_target_forward_seconds_count")
    results: list[tuple[Run, list[tuple[float, int]]] | BaseException] = []
    start = time.perf_counter()

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        try:
            results.append(
                await _spec_generate(
                    client, prompts[i % len(prompts)], max_new, temperature, seed + i, gamma, "model"
                )
            )
        except Exception as exc:  # counted, reported
            results.append(exc)

    await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    elapsed = time.perf_counter() - start
    ok = [r for r in results if not isinstance(r, BaseException)]
    ttft = [r.first_token_s for r, _ in ok]
    # Inter-token latency as a reader sees it: a chunk's gap since the previous
    # chunk, spread over the chunk's tokens.
    itl = [(b - a) / n for _, st in ok for (a, _), (b, n) in itertools.pairwise(st) for _ in range(n)]
    queue = [r.queue_s / max(r.rounds, 1) for r, _ in ok]
    committed = sum(r.tokens for r, _ in ok)
    proposed = sum(r.proposed for r, _ in ok)
    accepted = sum(r.accepted for r, _ in ok)

    def q(xs, p):
        return float(np.percentile(xs, p)) if xs else float("nan")

    return LoadPoint(
        mode=mode,
        rate_rps=rate,
        requests=len(arrivals),
        completed=len(ok),
        errors=len(results) - len(ok),
        duration_s=elapsed,
        throughput_tok_s=committed / elapsed,
        ttft_p50_s=q(ttft, 50),
        ttft_p99_s=q(ttft, 99),
        itl_p50_s=q(itl, 50),
        itl_p99_s=q(itl, 99),
        queue_p50_s=q(queue, 50),
        committed_tokens=committed,
        proposed_tokens=proposed,
        accepted_tokens=accepted,
        wasted_tokens=proposed - accepted,
        target_positions=int(_metric("specserve_target_positions_processed_total") - positions0),
        target_forward_passes=int(_metric("specserve_target_forward_seconds_count") - passes0),
    )


# --------------------------------------------------------------------------- main


def summarize_single(runs: list[Run]) -> dict:
    """Medians and quartiles of ms/token per (prompt set, temperature, mode)."""
    out: dict = {}
    keys = sorted({(r.prompt_set, r.temperature) for r in runs})
    for set_name, temp in keys:
        group = {}
        for mode in dict.fromkeys(r.mode for r in runs):
            xs = [
                r.ms_per_token
                for r in runs
                if (r.prompt_set, r.temperature, r.mode) == (set_name, temp, mode)
            ]
            if not xs:
                continue
            sel = [r for r in runs if (r.prompt_set, r.temperature, r.mode) == (set_name, temp, mode)]
            proposed = sum(r.proposed for r in sel)
            group[mode] = {
                "ms_per_token_median": statistics.median(xs),
                "ms_per_token_q1": float(np.percentile(xs, 25)),
                "ms_per_token_q3": float(np.percentile(xs, 75)),
                "acceptance": (sum(r.accepted for r in sel) / proposed) if proposed else None,
                "tokens_per_round": (sum(r.tokens for r in sel) / sum(r.rounds for r in sel))
                if sum(r.rounds for r in sel)
                else None,
                "n": len(xs),
            }
        out[f"{set_name} T={temp:g}"] = group
    return out


def greedy_identity(runs: list[Run]) -> dict:
    """Fraction of greedy specserve runs token-identical to HF target-only on the same prompt."""
    ref = {
        (r.prompt_set, r.prompt): r.token_ids
        for r in runs
        if r.mode == "hf target-only" and r.temperature == 0
    }
    same = total = 0
    for r in runs:
        if r.temperature == 0 and r.mode.startswith("specserve"):
            total += 1
            same += r.token_ids == ref.get((r.prompt_set, r.prompt))
    return {"identical": same, "total": total}


async def run_all(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.client import AsyncClient
    from specserve.local import start_local_stack

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(
        args.target, local_files_only=True, dtype=torch.float32
    ).eval()
    draft = AutoModelForCausalLM.from_pretrained(
        args.draft, local_files_only=True, dtype=torch.float32
    ).eval()

    files, heldout_ok = heldout_files(args.target)
    prompts = {
        "code": code_prompts(files, args.code_prompts, max_chars=args.prompt_chars),
        "prose": prose_prompts(files, args.prose_prompts, max_chars=args.prompt_chars // 2),
    }
    costs = measure_costs(target, draft, repeats=args.cost_repeats)

    stack = await start_local_stack(
        target_model=args.target, draft_model=args.draft, redis_url=args.redis_url
    )
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            # warm-up: one short generation per mode family
            for gamma in (0, 4, None):
                await _spec_generate(client, [1, 2, 3], 8, 0.0, 0, gamma, "model")
            runs = await single_stream(
                client, target, draft, tokenizer, prompts, args.temperatures, args.max_new_tokens, args.seed
            )
            summary = summarize_single(runs)
            greedy_code = summary.get("code T=0", {})
            best_fixed = min(
                FIXED_GAMMAS,
                key=lambda g: greedy_code.get(f"specserve gamma={g}", {}).get(
                    "ms_per_token_median", float("inf")
                ),
            )
            load: list[LoadPoint] = []
            load_prompts = [tokenizer(p.text).input_ids for p in prompts["code"]]
            modes = [
                ("specserve gamma=0", 0),
                (f"specserve gamma={best_fixed}", best_fixed),
                ("specserve adaptive", None),
            ]
            bar = tqdm(total=len(modes) * len(args.rates), desc="load sweep", unit="point")
            for rate in args.rates:
                for mode, gamma in modes:
                    load.append(
                        await load_point(
                            client,
                            load_prompts,
                            rate,
                            args.load_duration_s,
                            args.load_max_new_tokens,
                            0.0,
                            gamma,
                            mode,
                            args.seed,
                        )
                    )
                    bar.update()
            bar.close()
    finally:
        await stack.stop()

    return {
        "command": " ".join(["python -m bench.harness", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "models": {"target": str(args.target), "draft": str(args.draft)},
        "heldout_prompts": heldout_ok,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "costs": asdict(costs),
        "single_stream": summary,
        "greedy_identity": greedy_identity(runs),
        "runs": [asdict(r) | {"ms_per_token": r.ms_per_token} for r in runs],
        "best_fixed_gamma": best_fixed,
        "load": [asdict(p) for p in load],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--code-prompts", type=int, default=4)
    parser.add_argument("--prose-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompt-chars", type=int, default=600, help="characters of each prompt")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--load-duration-s", type=float, default=15.0)
    parser.add_argument("--load-max-new-tokens", type=int, default=64)
    parser.add_argument("--cost-repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from bench.report import write_report
    from specserve.cli import private_redis
    from specserve.logs import configure_logging

    configure_logging("console", "warning")  # per-round debug events would be timed too

    async def go():
        with private_redis(args.redis_url) as url:
            args.redis_url = url
            return await run_all(args)

    data = asyncio.run(go())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
    write_report(data, args.out)
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
