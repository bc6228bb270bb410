"""The target's linear kernels, stock against packed oneDNN: what a pass over k positions costs, and
whether greedy output stays the same.

Run (one run, one machine; docs/benchmarks/kernels.md comes from it)::

    python -m specserve.bench.kernels --out docs/benchmarks

Two copies of the target in this process, one with PyTorch's stock linear
kernels and one with packed oneDNN weights (:mod:`specserve.engine.cpu_kernels`):

* **pass cost**: one pass over k = 1..9 new positions after a 128-token
  context with a warm KV cache (:func:`specserve.bench.costs.measure_costs`' timing), the
  two copies alternating round by round so drift on a shared machine hits both;
  each k as a multiple of the same copy's one-position step;
* **greedy output**: HF ``generate()`` of held-out chat and code prompts with
  each copy, token for token;
* **the draft's drafting step**: one session's proposals of ``--draft-gamma``
  tokens through the draft service's row-invariant pass
  (:class:`draft_service.proposers.ModelProposer`), with the stock kernels (in
  16-row blocks) and with packed weights (rows unpadded where the kernel
  allows), each round catching up on two committed tokens as a real round
  does; beside them the plain model's one-position step, the cost model's
  draft step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench.costs import random_context, time_pass
from specserve.bench.harness import DEFAULT_DRAFT, DEFAULT_TARGET, _run_header
from specserve.bench.pair import ignore_eos

#: kernels.md: what follows this line is written by hand and kept when the measurements are rerun.
NOTES = "<!-- notes: kept by specserve.bench.kernels -->"


def _load(target: str, kernels: str):
    from specserve.engine.models import load_model, resolve_model_path

    return load_model(resolve_model_path(target, "target"), device="cpu", dtype="float32", kernels=kernels)


def draft_steps(args: argparse.Namespace) -> dict[str, float]:
    """ms per drafted token: the row-invariant pass with each kernel path, and the plain model's step."""
    from draft_service.proposers import DraftRequest, ModelProposer
    from specserve.api.params import SamplingParams
    from specserve.engine.kvcache import SessionCacheStore
    from specserve.engine.models import load_model, resolve_model_path

    path = resolve_model_path(args.draft, "draft")
    proposers = {}
    for name in ("stock", "onednn"):  # a copy each: the proposer switches its model's attention function
        model = load_model(path, device="cpu", dtype="float32").model
        store = SessionCacheStore(model, max_sessions=2, budget_bytes=1 << 30, ttl_s=3600.0)
        proposers[name] = ModelProposer(store, kernels=name)
    plain = load_model(path, device="cpu", dtype="float32").model
    vocab = plain.config.vocab_size
    committed = {name: torch.randint(0, vocab, (128,)).tolist() for name in proposers}
    times: dict[str, list[float]] = {name: [] for name in (*proposers, "plain")}
    plain_cache = random_context(plain, 128)
    for _ in tqdm(range(args.rounds), desc="draft step", unit="round"):
        for name, proposer in proposers.items():
            for _ in range(args.repeats + 1):
                request = DraftRequest(
                    session_id="s",
                    committed=tuple(committed[name]),
                    gamma=args.draft_gamma,
                    sampling=SamplingParams(temperature=0.0),
                    seed=0,
                )
                start = time.perf_counter()
                drafted = proposer.propose(request)
                times[name].append(1e3 * (time.perf_counter() - start) / args.draft_gamma)
                committed[name] += [drafted.token_ids[0], 5]  # one accepted, a bonus token: the next catch-up
            times[name].pop(-args.repeats - 1)  # the first of the round warms the path back up
        times["plain"].append(time_pass(plain, plain_cache, 1, args.repeats))
    return {name: statistics.median(v) for name, v in times.items()}


def greedy_outputs(models: dict, tokenizer, prompts_per_kind: int, max_new_tokens: int) -> list[dict]:
    """HF ``generate()`` of ``prompts_per_kind`` held-out chat and code prompts with each of two ``models``
    (name -> model), greedy, ``max_new_tokens`` each (EOS ignored): per prompt, whether the two agree token
    for token, the first token where they differ (None: nowhere) and each model's seconds."""
    from specserve.bench.chat_prompts import heldout_prompts

    first_name, second_name = models
    prompts = [p for kind in ("chat", "code") for p in heldout_prompts(kind, prompts_per_kind)]
    greedy = []
    for p in tqdm(prompts, desc="greedy output", unit="prompt"):
        text = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        outs, secs = {}, {}
        for name, model in models.items():
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    **ignore_eos(model),
                )
            secs[name] = time.perf_counter() - start
            outs[name] = out[0, ids.shape[1] :].tolist()
        same = outs[first_name] == outs[second_name]
        pairs = enumerate(zip(outs[first_name], outs[second_name], strict=True))  # both ran max_new_tokens
        first = None if same else next(i for i, (a, b) in pairs if a != b)
        greedy.append({"prompt": p.name, "identical": same, "first_difference": first, "seconds": secs})
    return greedy


def add_pass_arguments(parser: argparse.ArgumentParser, *, prompts: int, max_new_tokens: int) -> None:
    """The options of a benchmark of two copies of the target: passes over 1..--max-k positions, then
    greedy output on held-out prompts; --threads, --out."""
    parser.add_argument("--max-k", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=prompts, help="held-out prompts per kind (chat, code)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))


def write_report(out: Path, name: str, data: dict, render) -> None:
    """``<out>/<name>.json`` (the data) and ``<out>/<name>.md`` (``render(data)``), also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{name}.md").write_text(render(data))
    print(render(data))


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    loaded = {name: _load(args.target, name) for name in ("stock", "onednn")}
    models = {name: m.model for name, m in loaded.items()}
    caches = {name: random_context(model, 128) for name, model in models.items()}
    ks = range(1, args.max_k + 1)
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in models}
    for _ in tqdm(range(args.rounds), desc="pass cost", unit="round"):
        for k in ks:
            for name, model in models.items():
                times[name][k].append(time_pass(model, caches[name], k, args.repeats))
    passes = {name: {k: statistics.median(v) for k, v in per_k.items()} for name, per_k in times.items()}

    greedy = greedy_outputs(models, loaded["stock"].tokenizer, args.prompts, args.max_new_tokens)
    return {
        **_run_header(args),
        "settings": {"rounds": args.rounds, "repeats": args.repeats, "context": 128, "threads": args.threads},
        "pass_ms": {name: {str(k): v for k, v in per_k.items()} for name, per_k in passes.items()},
        "draft_gamma": args.draft_gamma,
        "draft_step_ms": draft_steps(args),
        "greedy": greedy,
        "max_new_tokens": args.max_new_tokens,
    }


def render(data: dict) -> str:
    stock, fast = data["pass_ms"]["stock"], data["pass_ms"]["onednn"]
    lines = [
        "# Linear kernels: stock against packed oneDNN (the target's pass, the draft's step)",
        "",
        f"Measured {data['date_utc']} UTC ({data['machine']['platform']}, {data['settings']['threads']} torch "
        f"threads, torch {data['machine']['torch']}), target `{Path(data['target']).name}` in float32; one run of:",
        "",
        f"```\n{data['command']}\n```",
        "",
        "One target pass over k new positions after a 128-token context, warm KV cache, batch 1 (median of "
        f"{data['settings']['rounds']} rounds x {data['settings']['repeats']} timings, the two kernel paths "
        "alternating). A verify pass at gamma feeds k = gamma + 1 positions.",
        "",
        "| k | stock ms | stock / its step | oneDNN packed ms | packed / its step | packed / stock |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in stock:
        lines.append(
            f"| {k} | {stock[k]:.1f} | {stock[k] / stock['1']:.2f}x | {fast[k]:.1f} | "
            f"{fast[k] / fast['1']:.2f}x | {fast[k] / stock[k]:.2f} |"
        )
    same = sum(g["identical"] for g in data["greedy"])
    hf = {name: sum(g["seconds"][name] for g in data["greedy"]) for name in ("stock", "onednn")}
    tokens = data["max_new_tokens"] * len(data["greedy"])
    lines += [
        "",
        f"Greedy output, HF `generate()` of {len(data['greedy'])} held-out chat and code prompts, "
        f"{data['max_new_tokens']} tokens each (EOS ignored): **{same} of {len(data['greedy'])} token-identical** "
        "between the two kernel paths"
        + (
            ""
            if same == len(data["greedy"])
            else " (first differences at "
            + ", ".join(f"{g['prompt']}: token {g['first_difference']}" for g in data["greedy"] if not g["identical"])
            + ")"
        )
        + f"; {1000 * hf['stock'] / tokens:.1f} ms/token stock, {1000 * hf['onednn'] / tokens:.1f} packed.",
        "",
    ]
    step = data.get("draft_step_ms")
    if step:
        lines += [
            "## The draft's drafting step",
            "",
            f"Draft `{Path(data['draft']).name}`: one session proposing {data['draft_gamma']} tokens through the "
            "draft service's row-invariant pass (a session's proposals are the same bits alone or in a batch), "
            "catching up on two committed tokens each time as a round does; ms per drafted token, median of "
            f"{data['settings']['rounds']} rounds x {data['settings']['repeats']} proposals.",
            "",
            "| path | ms per drafted token | vs the plain step |",
            "| --- | --- | --- |",
            f"| stock kernels, 16-row blocks | {step['stock']:.2f} | {step['stock'] / step['plain']:.2f}x |",
            f"| packed oneDNN, rows unpadded where the kernel allows (the draft's default) | {step['onednn']:.2f} | "
            f"{step['onednn'] / step['plain']:.2f}x |",
            f"| plain model step, 1 position (the cost model's draft step; not batch-invariant) | "
            f"{step['plain']:.2f} | 1.00x |",
            "",
        ]
    notes = data.get("notes")
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--draft-gamma", type=int, default=4, help="tokens per proposal in the draft's timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    add_pass_arguments(parser, prompts=6, max_new_tokens=64)
    args = parser.parse_args(argv)
    args.command = "python -m specserve.bench.kernels " + " ".join(argv if argv is not None else sys.argv[1:])
    data = measure(args)
    old = args.out / "kernels.md"
    if old.exists() and NOTES in old.read_text():  # the hand-written part after the marker stays
        data["notes"] = NOTES + old.read_text().split(NOTES, 1)[1]
    write_report(args.out, "kernels", data, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
