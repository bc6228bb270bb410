"""What invariant target passes cost: a decoding step and a verify pass, stock passes against invariant ones.

Run (one run, one machine; docs/benchmarks/invariance.md comes from it)::

    python -m specserve.bench.invariance --out docs/benchmarks

Copies of the target in this process, for each linear kernel path of
``--kernels``: the stock passes (:func:`specserve.engine.models.load_model`,
transformers' attention) and invariant ones (:func:`specserve.engine.invariant.prepare`):

* **pass cost**: one pass over k new positions (k = 1, a decoding step, and
  each of ``--ks``) after a context of each ``--contexts`` length with a warm KV
  cache (:func:`specserve.bench.costs.time_pass`), in ``--pairs`` pairs of
  timings, the stock and the invariant copy back to back in alternating order,
  by default in the thread's CPU time on one thread (``--clock cpu``: what a
  pass costs, little moved by other processes on a shared machine);
  the cost is the median of the pairs' ratios, so drift on a shared machine
  cancels out of it;
* **prefill cost**: a prompt of each ``--prefills`` length into a new cache,
  ``--prefill-pairs`` pairs;
* **greedy output**: HF ``generate()`` of held-out chat and code prompts with
  each copy, token for token (the stock copy is stock transformers);
* **the same bits**: for each copy, whether the logits of the last positions
  are ``torch.equal`` from one-position steps, from one pass over them and
  from a prefill of the whole sequence.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from specserve.bench.costs import random_context
from specserve.bench.harness import DEFAULT_TARGET, _run_header
from specserve.bench.kernels import greedy_outputs, write_report
from specserve.bench.pair import forward, prefilled

PASSES = ("stock", "invariant")


def _copies(target: str, kernels: str) -> dict[str, object]:
    from specserve.engine import invariant
    from specserve.engine.models import load_model, resolve_model_path

    path = resolve_model_path(target, "target")
    models = {name: load_model(path, device="cpu", dtype="float32", kernels=kernels).model for name in PASSES}
    invariant.prepare(models["invariant"])
    return models


def _tokenizer(target: str):
    from transformers import AutoTokenizer

    from specserve.engine.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(target, "target"), local_files_only=True)


def _positions_agree(model, context: list[int], k: int) -> bool:
    """Whether the logits of the last ``k`` positions of ``context`` are the same bits from ``k`` one-position
    steps, from one pass over the ``k``, and from one prefill of the whole ``context``."""
    head, tail = context[:-k], context[-k:]
    with torch.inference_mode():
        whole = forward(model, context, DynamicCache(config=model.config))[-k:]  # [k, vocab]
        cache = prefilled(model, head)
        together = forward(model, tail, cache)  # [k, vocab]
        cache.crop(-k)
        steps = torch.cat([forward(model, [t], cache) for t in tail])  # [k, vocab]
    return torch.equal(together, steps) and torch.equal(whole, together)


def _time_pass(model, cache, k: int, clock) -> float:
    """ms by ``clock`` (ns) of one pass over ``k`` random positions after ``cache`` (left as it was)."""
    ids = torch.randint(0, model.config.vocab_size, (k,)).tolist()
    with torch.inference_mode():
        start = clock()
        forward(model, ids, cache)
        elapsed = clock() - start
    cache.crop(-k)
    return elapsed / 1e6


def _time_prefill(model, ids: list[int], clock) -> float:
    """ms by ``clock`` (ns) of a prefill of ``ids`` into a new cache, the logits of the last position only."""
    with torch.inference_mode():
        start = clock()
        model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        return (clock() - start) / 1e6


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    ks = (1, *args.ks)
    cost: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    same: dict[str, dict[str, bool]] = {}
    prefill: dict[str, dict[str, dict[str, float]]] = {}
    greedy: dict[str, list[dict]] = {}
    tokenizer = _tokenizer(args.target)
    for kernels in args.kernels:
        models = _copies(args.target, kernels)
        vocab = models["stock"].config.vocab_size
        cost[kernels] = {}
        for length in args.contexts:
            caches = {name: random_context(model, length) for name, model in models.items()}
            times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in PASSES}
            for k in tqdm(ks, desc=f"{kernels} kernels, context {length}", unit="k"):
                for name in PASSES:  # warm-up
                    for _ in range(2):
                        _time_pass(models[name], caches[name], k, clock)
                for r in range(args.pairs):
                    for name in PASSES if r % 2 == 0 else PASSES[::-1]:
                        times[name][k].append(_time_pass(models[name], caches[name], k, clock))
            cost[kernels][str(length)] = {
                str(k): {
                    "stock_ms": statistics.median(times["stock"][k]),
                    "invariant_ms": statistics.median(times["invariant"][k]),
                    "ratio": statistics.median(
                        i / s for i, s in zip(times["invariant"][k], times["stock"][k], strict=True)
                    ),
                }
                for k in ks
            }
        prefill[kernels] = {}
        for length in args.prefills:
            ids = torch.randint(0, vocab, (length,)).tolist()
            spent: dict[str, list[float]] = {name: [] for name in PASSES}
            for r in tqdm(range(args.prefill_pairs), desc=f"{kernels} kernels, prefill {length}", unit="pair"):
                for name in PASSES if r % 2 == 0 else PASSES[::-1]:
                    spent[name].append(_time_prefill(models[name], ids, clock))
            prefill[kernels][str(length)] = {
                "stock_ms": statistics.median(spent["stock"]),
                "invariant_ms": statistics.median(spent["invariant"]),
                "ratio": statistics.median(i / s for i, s in zip(spent["invariant"], spent["stock"], strict=True)),
            }
        if args.prompts:
            greedy[kernels] = greedy_outputs(models, tokenizer, args.prompts, args.max_new_tokens)
        context = torch.randint(0, vocab, (args.contexts[0],)).tolist()
        same[kernels] = {name: _positions_agree(model, context, max(ks)) for name, model in models.items()}
        del models
    return {
        **_run_header(args),
        "settings": {
            "pairs": args.pairs,
            "prefill_pairs": args.prefill_pairs,
            "threads": args.threads,
            "clock": args.clock,
        },
        "cost": cost,
        "prefill": prefill,
        "greedy": greedy,
        "max_new_tokens": args.max_new_tokens,
        "same_bits": same,
    }


def render(data: dict) -> str:
    s = data["settings"]
    lines = [
        "# Invariant target passes: what they cost",
        "",
        f"Measured {data['date_utc']} UTC ({data['machine']['platform']}, {s['threads']} torch threads, "
        f"{'CPU time of the model thread' if s.get('clock') == 'cpu' else 'wall-clock time'}, torch "
        f"{data['machine']['torch']}), target `{Path(data['target']).name}` in float32; one run of:",
        "",
        f"```\n{data['command']}\n```",
        "",
        "One target pass over k new positions after the context, warm KV cache, batch 1: "
        f"{s['pairs']} pairs of timings per k, the stock and the invariant pass back to back, the order "
        "alternating; ms are medians, 'invariant / stock' the median of the pairs' ratios. k = 1 is a decoding "
        "step; a verify pass at gamma feeds k = gamma + 1 positions. 'Stock' is the target as it loads without "
        "invariance (transformers' attention, grouped heads read in place; the linear kernels named).",
        "",
    ]
    for kernels, per_context in data["cost"].items():
        lines += [f"## Linear kernels `{kernels}`", ""]
        lines += [
            "| context | k | stock ms | invariant ms | invariant / stock |",
            "| --- | --- | --- | --- | --- |",
        ]
        for length, per_k in per_context.items():
            for k, row in per_k.items():
                lines.append(
                    f"| {length} | {k} | {row['stock_ms']:.1f} | {row['invariant_ms']:.1f} | {row['ratio']:.3f} |"
                )
        prefills = data.get("prefill", {}).get(kernels, {})
        if prefills:
            lines += [
                "",
                f"A prefill of the prompt into a new cache (median of {s.get('prefill_pairs')} pairs):",
                "",
                "| prompt tokens | stock ms | invariant ms | invariant / stock |",
                "| --- | --- | --- | --- |",
            ]
            lines += [
                f"| {length} | {row['stock_ms']:.1f} | {row['invariant_ms']:.1f} | {row['ratio']:.3f} |"
                for length, row in prefills.items()
            ]
        runs = data.get("greedy", {}).get(kernels, [])
        if runs:
            same_text = sum(g["identical"] for g in runs)
            lines += [
                "",
                f"Greedy output, HF `generate()` of {len(runs)} held-out chat and code prompts, "
                f"{data['max_new_tokens']} tokens each (EOS ignored), with the stock and the invariant passes: "
                f"**{same_text} of {len(runs)} token-identical**"
                + (
                    ""
                    if same_text == len(runs)
                    else " (first differences at "
                    + ", ".join(f"{g['prompt']}: token {g['first_difference']}" for g in runs if not g["identical"])
                    + ": near-ties the two roundings break differently)"
                )
                + ".",
            ]
        bits = data["same_bits"][kernels]
        lines += [
            "",
            "The last positions' logits the same bits from one-position steps, one pass over them and one "
            "prefill: " + ", ".join(f"{name} **{'yes' if ok else 'no'}**" for name, ok in bits.items()) + ".",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.invariance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--kernels", nargs="+", default=["stock", "onednn"], choices=["stock", "onednn"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--ks", type=int, nargs="*", default=[5], help="verify pass widths timed besides k = 1")
    parser.add_argument("--pairs", type=int, default=30, help="pairs of timings (one pass of each copy) per k")
    parser.add_argument("--prefills", type=int, nargs="*", default=[128, 512], help="prompt lengths prefilled")
    parser.add_argument("--prefill-pairs", type=int, default=5, help="pairs of timings per prefill length")
    parser.add_argument("--prompts", type=int, default=3, help="held-out prompts per kind (chat, code); 0: none")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: the model thread's CPU time, with --threads 1 (what a pass costs, little moved by other "
        "processes on a shared machine); wall: elapsed time",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use --threads 1")
    args.command = "python -m specserve.bench.invariance " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(args.out, "invariance", render=render, data=measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
