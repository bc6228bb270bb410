"""What invariant target passes cost: a decoding step and a verify pass, stock passes against invariant ones.

Run (one run, one machine; docs/benchmarks/invariance.md comes from it)::

    python -m benchmarks invariance --out docs/benchmarks

Copies of the target in this process, for each linear kernel path of
``--kernels``: the stock passes (:func:`specserve.engine.models.load_model`,
transformers' attention) and invariant ones (:func:`specserve.engine.position_invariant.prepare`):

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

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.kernels import greedy_outputs
from benchmarks.options import InvarianceOptions
from specserve.bench import markdown as md
from specserve.bench.costs import random_context
from specserve.bench.pair import forward, prefilled
from specserve.bench.runner import Header
from specserve.bench.timing import Stopwatch

PASSES = ("stock", "invariant")


def _copies(target: str, kernels: str) -> dict[str, object]:
    from specserve.engine import position_invariant
    from specserve.engine.models import load_model, resolve_model_path

    path = resolve_model_path(target, "target")
    models = {name: load_model(path, device="cpu", dtype="float32", kernels=kernels).model for name in PASSES}
    position_invariant.prepare(models["invariant"])
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
    with torch.inference_mode(), Stopwatch(clock) as sw:
        forward(model, ids, cache)
    cache.crop(-k)
    return 1000.0 * sw.seconds


def _time_prefill(model, ids: list[int], clock) -> float:
    """ms by ``clock`` (ns) of a prefill of ``ids`` into a new cache, the logits of the last position only."""
    with torch.inference_mode(), Stopwatch(clock) as sw:
        model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return 1000.0 * sw.seconds


def measure(args: InvarianceOptions) -> dict:
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
        **Header.of(args).to_json(),
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
        *md.command_block(data["command"]),
        "One target pass over k new positions after the context, warm KV cache, batch 1: "
        f"{s['pairs']} pairs of timings per k, the stock and the invariant pass back to back, the order "
        "alternating; ms are medians, 'invariant / stock' the median of the pairs' ratios. k = 1 is a decoding "
        "step; a verify pass at gamma feeds k = gamma + 1 positions. 'Stock' is the target as it loads without "
        "invariance (transformers' attention, grouped heads read in place; the linear kernels named).",
        "",
    ]
    for kernels, per_context in data["cost"].items():
        lines += [f"## Linear kernels `{kernels}`", ""]
        lines += md.table(
            ("context", "k", "stock ms", "invariant ms", "invariant / stock"),
            ((length, k, f"{row['stock_ms']:.1f}", f"{row['invariant_ms']:.1f}", f"{row['ratio']:.3f}")
             for length, per_k in per_context.items() for k, row in per_k.items()),
        )  # fmt: skip
        prefills = data.get("prefill", {}).get(kernels, {})
        if prefills:
            lines += [
                "",
                f"A prefill of the prompt into a new cache (median of {s.get('prefill_pairs')} pairs):",
                "",
                *md.table(
                    ("prompt tokens", "stock ms", "invariant ms", "invariant / stock"),
                    ((length, f"{row['stock_ms']:.1f}", f"{row['invariant_ms']:.1f}", f"{row['ratio']:.3f}")
                     for length, row in prefills.items()),
                ),
            ]  # fmt: skip
        runs = data.get("greedy", {}).get(kernels, [])
        if runs:
            same_text, greedy = md.greedy_line(
                runs, data["max_new_tokens"], ", with the stock and the invariant passes"
            )
            if same_text != len(runs):
                greedy += f" (first differences at {md.first_differences(runs)}: near-ties the two roundings break differently)"
            lines += ["", greedy + "."]
        bits = data["same_bits"][kernels]
        lines += [
            "",
            "The last positions' logits the same bits from one-position steps, one pass over them and one "
            "prefill: " + ", ".join(f"{name} **{'yes' if ok else 'no'}**" for name, ok in bits.items()) + ".",
            "",
        ]
    return "\n".join(lines)


def main(opts: InvarianceOptions) -> int:
    """``python -m benchmarks invariance``: ``<out>/invariance.json`` and ``invariance.md``."""
    data = measure(opts)
    print(render(data))
    md.write(opts.out, "invariance", render(data), data)
    return 0
