"""The target's attention over several new positions: transformers' SDPA against grouped heads read in
place (:mod:`specserve.engine.attention`), what a pass over k positions costs, and whether anything changes.

Run (one run, one machine; docs/benchmarks/attention.md comes from it)::

    python -m specserve.bench.attention --out docs/benchmarks

Two copies of the target in this process, on the same linear kernels
(``--kernels``, the target service's path), one on transformers' SDPA attention
and one on :func:`specserve.engine.attention.grouped_sdpa`:

* **pass cost**: one pass over k = 1..9 new positions after a context of each
  ``--contexts`` length with a warm KV cache (:func:`specserve.bench.costs.time_pass`), in
  ``--pairs`` pairs of timings per k, one pass of each copy back to back in
  alternating order; the ratio is the median of the pairs' ratios, so drift on a
  shared machine cancels out of it;
* **the same bits**: each pass's logits compared with ``torch.equal``;
* **greedy output**: HF ``generate()`` of held-out chat and code prompts with
  each copy, token for token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench.costs import random_context, time_pass
from specserve.bench.harness import DEFAULT_TARGET, _run_header
from specserve.bench.kernels import add_pass_arguments, greedy_outputs, write_report
from specserve.bench.pair import forward, prefilled

COPIES = ("sdpa", "grouped")


def _copies(target: str, kernels: str) -> dict[str, object]:
    from specserve.engine import attention
    from specserve.engine.models import load_model, resolve_model_path

    path = resolve_model_path(target, "target")
    models = {name: load_model(path, device="cpu", dtype="float32", kernels=kernels) for name in COPIES}
    models["sdpa"].model.set_attn_implementation("sdpa")
    if models["grouped"].model.config._attn_implementation != attention.ATTENTION:  # load_model's choice
        raise SystemExit(f"{path} has no grouped-query attention on the CPU: nothing to compare")
    return models


def _same_bits(models: dict, context: list[int], k: int) -> bool:
    """Whether a pass over ``k`` random positions after ``context`` gives both copies the same logits."""
    ids = torch.randint(0, models["sdpa"].model.config.vocab_size, (k,)).tolist()
    with torch.inference_mode():
        logits = [forward(m.model, ids, prefilled(m.model, context)) for m in models.values()]
    return torch.equal(logits[0], logits[1])


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = _copies(args.target, args.kernels)
    ks = range(1, args.max_k + 1)
    passes: dict[str, dict[str, dict[str, float]]] = {}
    same: dict[str, dict[str, bool]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for length in args.contexts:
        caches = {name: random_context(m.model, length) for name, m in loaded.items()}
        times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in COPIES}
        for k in tqdm(ks, desc=f"pass cost, context {length}", unit="k"):
            for name in COPIES:  # warm-up
                time_pass(loaded[name].model, caches[name], k, 1)
            for r in range(args.pairs):  # one timing of each copy, back to back, in alternating order
                for name in COPIES if r % 2 == 0 else COPIES[::-1]:
                    times[name][k].append(time_pass(loaded[name].model, caches[name], k, 1, warmup=0))
        passes[str(length)] = {
            name: {str(k): statistics.median(v) for k, v in per_k.items()} for name, per_k in times.items()
        }
        # Each pair's ratio, taken within a fraction of a second: slow drift cancels out of it.
        ratios[str(length)] = {
            str(k): statistics.median(g / s for g, s in zip(times["grouped"][k], times["sdpa"][k], strict=True))
            for k in ks
        }
        context = torch.randint(0, loaded["sdpa"].model.config.vocab_size, (length,)).tolist()
        same[str(length)] = {str(k): _same_bits(loaded, context, k) for k in ks}

    models = {name: m.model for name, m in loaded.items()}
    greedy = greedy_outputs(models, loaded["sdpa"].tokenizer, args.prompts, args.max_new_tokens)
    return {
        **_run_header(args),
        "kernels": args.kernels,
        "settings": {"pairs": args.pairs, "threads": args.threads},
        "pass_ms": passes,
        "pair_ratio": ratios,
        "same_bits": same,
        "greedy": greedy,
        "max_new_tokens": args.max_new_tokens,
    }


def render(data: dict) -> str:
    s = data["settings"]
    lines = [
        "# Attention over several new positions: transformers' SDPA against grouped heads read in place",
        "",
        f"Measured {data['date_utc']} UTC ({data['machine']['platform']}, {s['threads']} torch threads, torch "
        f"{data['machine']['torch']}), target `{Path(data['target']).name}` in float32, linear kernels "
        f"`{data['kernels']}`; one run of:",
        "",
        f"```\n{data['command']}\n```",
        "",
        "One target pass over k new positions after the context, warm KV cache, batch 1: "
        f"{s['pairs']} pairs of timings per k, one pass of each copy back to back, the order alternating; ms "
        "are medians, 'grouped / SDPA' the median of the pairs' ratios (slow drift cancels out of a pair). A "
        "verify pass at gamma feeds k = gamma + 1 positions; k = 1 is a decode step, where transformers "
        "already reads the grouped heads in place (both copies run the same code there: its ratio is the "
        "noise floor). 'same bits': the pass's logits are `torch.equal` across the copies.",
        "",
    ]
    for length, per in data["pass_ms"].items():
        sdpa, grouped = per["sdpa"], per["grouped"]
        lines += [
            f"## Context {length} tokens",
            "",
            "| k | transformers' SDPA ms | grouped in place ms | grouped / SDPA | same bits |",
            "| --- | --- | --- | --- | --- |",
        ]
        for k in sdpa:
            bits = "yes" if data["same_bits"][length][k] else "**no**"
            ratio = data["pair_ratio"][length][k]
            lines.append(f"| {k} | {sdpa[k]:.1f} | {grouped[k]:.1f} | {ratio:.3f} | {bits} |")
        lines.append("")
    same = sum(g["identical"] for g in data["greedy"])
    lines += [
        f"Greedy output, HF `generate()` of {len(data['greedy'])} held-out chat and code prompts, "
        f"{data['max_new_tokens']} tokens each (EOS ignored): **{same} of {len(data['greedy'])} token-identical** "
        "between the two copies.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--kernels", default="onednn", choices=["stock", "onednn"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--pairs", type=int, default=30, help="pairs of timings (one pass of each copy) per k")
    add_pass_arguments(parser, prompts=3, max_new_tokens=48)
    args = parser.parse_args(argv)
    args.command = "python -m specserve.bench.attention " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(args.out, "attention", render=render, data=measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
