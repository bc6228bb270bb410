"""The target's attention over several new positions: transformers' SDPA against grouped heads read in
place (:mod:`specserve.engine.attention`), what a pass over k positions costs, and whether anything changes.

Run (one run, one machine; docs/benchmarks/attention.md comes from it)::

    python -m benchmarks attention --out docs/benchmarks

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

import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.kernels import greedy_outputs
from benchmarks.options import AttentionOptions
from specserve.bench import markdown as md
from specserve.bench.costs import random_context, time_pass
from specserve.bench.pair import forward, prefilled
from specserve.bench.runner import Header

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


def measure(args: AttentionOptions) -> dict:
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
        **Header.of(args).to_json(),
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
        *md.command_block(data["command"]),
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
        header = ("k", "transformers' SDPA ms", "grouped in place ms", "grouped / SDPA", "same bits")
        cells = [
            (k, f"{sdpa[k]:.1f}", f"{grouped[k]:.1f}", f"{data['pair_ratio'][length][k]:.3f}",
             "yes" if data["same_bits"][length][k] else "**no**")
            for k in sdpa
        ]  # fmt: skip
        lines += [f"## Context {length} tokens", "", *md.table(header, cells), ""]
    _, greedy = md.greedy_line(data["greedy"], data["max_new_tokens"], "")
    lines += [greedy + " between the two copies.", ""]
    return "\n".join(lines)


def main(opts: AttentionOptions) -> int:
    """``python -m benchmarks attention``: ``<out>/attention.json`` and ``attention.md``."""
    opts.threads = opts.threads or torch.get_num_threads()
    data = measure(opts)
    print(render(data))
    md.write(opts.out, "attention", render(data), data)
    return 0
