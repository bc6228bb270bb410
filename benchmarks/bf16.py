"""bfloat16 against float32 for the target and the draft on this CPU (issue 53, item 4).

One-off study, not shipped in the wheel: does a bfloat16 model pay here, at the widths and batch sizes
the service uses? For each dtype: a pass over k new positions after a 128-token context for a batch of
b sessions (k = 1 is a decoding step, k = 5 a verify pass at gamma 4), the model thread's CPU time on
one thread (little moved by other processes on a shared machine), median of alternating rounds; then
greedy HF generate() of held-out chat prompts in both dtypes, and where bfloat16's output first leaves
float32's. Writes a Markdown table to stdout and JSON to --json.

    python -m benchmarks bf16 --json docs/benchmarks/bf16.json > docs/benchmarks/bf16.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import specserve.engine.draft_model  # noqa: F401  (registers the draft's model type)
from specserve.engine.kernel_choice import cpu_model_and_flags
from specserve.engine.models import resolve_model_path
from specserve.prompts.chat import heldout_prompts


def pass_ms(model, batch: int, k: int, context: int, rounds: int) -> float:
    vocab = model.config.vocab_size
    ids = torch.tensor([[(7919 * i + 13 * b) % vocab for i in range(context + k)] for b in range(batch)])
    cache = DynamicCache(config=model.config)
    times = []
    with torch.inference_mode():
        model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
        for r in range(rounds + 1):
            t0 = time.thread_time_ns()
            model(input_ids=ids[:, context:], cache=cache, use_cache=True, logits_to_keep=k)
            if r:
                times.append(time.thread_time_ns() - t0)
            cache.crop(-k)
    return statistics.median(times) / 1e6


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cpu, flags = cpu_model_and_flags()
    target = resolve_model_path("smollm2-135m-instruct", "target")
    draft = resolve_model_path("specserve-smollm2-draft", "draft")
    rows = []
    for role, path in (("target", target), ("draft", draft)):
        models = {dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval() for dt in (torch.float32, torch.bfloat16)}
        for batch in (1, 4, 8):
            for k in (1, 5):
                ms = {str(dt).removeprefix("torch."): [] for dt in models}
                for _ in range(3):  # alternate the dtypes: drift falls on both
                    for dt, m in models.items():
                        ms[str(dt).removeprefix("torch.")].append(pass_ms(m, batch, k, 128, args.rounds))
                f32, bf16 = statistics.median(ms["float32"]), statistics.median(ms["bfloat16"])
                rows.append({"role": role, "batch": batch, "k": k, "float32_ms": f32, "bfloat16_ms": bf16,
                             "bf16_over_f32": bf16 / f32})
    tok = AutoTokenizer.from_pretrained(target)
    models = {dt: AutoModelForCausalLM.from_pretrained(target, dtype=dt).eval() for dt in (torch.float32, torch.bfloat16)}
    greedy = []
    for p in heldout_prompts("chat", args.prompts // 2) + heldout_prompts("code", args.prompts - args.prompts // 2):
        ids = tok.apply_chat_template(list(p.messages), add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        outs = {}
        for dt, m in models.items():
            with torch.inference_mode():
                out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, eos_token_id=m.config.vocab_size + 1, pad_token_id=0)
            outs[dt] = out[0, ids.shape[1]:].tolist()
        greedy.append({"prompt": p.name, "first_difference": first_difference(outs[torch.float32], outs[torch.bfloat16])})
    data = {"cpu": cpu, "flags": flags, "torch": torch.__version__, "platform": platform.platform(),
            "passes": rows, "greedy": greedy, "max_new_tokens": args.max_new_tokens}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    print(f"# bfloat16 against float32 on {cpu}\n")
    print(f"Flags: {' '.join(flags)}; torch {torch.__version__}; one thread, the model thread's CPU time; "
          "a pass over k new positions after 128 tokens for a batch of b sessions (median of 3 x "
          f"{args.rounds} alternating rounds). Command: `python -m benchmarks bf16`.\n")
    print("| model | batch | k | float32 ms | bfloat16 ms | bfloat16 / float32 |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['role']} | {r['batch']} | {r['k']} | {r['float32_ms']:.1f} | {r['bfloat16_ms']:.1f} | {r['bf16_over_f32']:.2f} |")
    same = sum(g["first_difference"] is None for g in greedy)
    diffs = [g["first_difference"] for g in greedy if g["first_difference"] is not None]
    print(f"\nGreedy HF generate() of {len(greedy)} held-out chat and code prompts, {args.max_new_tokens} tokens, EOS "
          f"ignored: bfloat16 identical to float32 on {same}; elsewhere it first differs at token "
          f"{', '.join(map(str, diffs)) or '-'}.")

