"""The target's linear kernels, stock against packed oneDNN: what a pass over k positions costs, and
whether greedy output stays the same.

Run (one run, one machine; docs/benchmarks/kernels.md comes from it)::

    python -m benchmarks kernels --out docs/benchmarks

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
  (:class:`specserve.draft.proposers.ModelProposer`), with the stock kernels (in
  16-row blocks) and with packed weights (rows unpadded where the kernel
  allows), each round catching up on two committed tokens as a real round
  does; beside them the plain model's one-position step, the cost model's
  draft step.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.options import KernelsOptions
from specserve.bench import markdown as md
from specserve.bench.costs import random_context, time_pass
from specserve.bench.pair import hf_generate
from specserve.bench.runner import Header
from specserve.bench.timing import Stopwatch

#: kernels.md: what follows this line is written by hand and kept when the measurements are rerun.
NOTES = "<!-- notes: kept by benchmarks.kernels -->"


def _load(target: str, kernels: str):
    from specserve.engine.models import load_model, resolve_model_path

    return load_model(resolve_model_path(target, "target"), device="cpu", dtype="float32", kernels=kernels)


def draft_steps(args: KernelsOptions) -> dict[str, float]:
    """ms per drafted token: the row-invariant pass with each kernel path, and the plain model's step."""
    from specserve.api.params import SamplingParams
    from specserve.draft.proposers import DraftRequest, ModelProposer
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
                with Stopwatch() as sw:
                    drafted = proposer.propose(request)
                times[name].append(1e3 * sw.seconds / args.draft_gamma)
                committed[name] += [drafted.token_ids[0], 5]  # one accepted, a bonus token: the next catch-up
            times[name].pop(-args.repeats - 1)  # the first of the round warms the path back up
        times["plain"].append(time_pass(plain, plain_cache, 1, args.repeats))
    return {name: statistics.median(v) for name, v in times.items()}


def greedy_outputs(models: dict, tokenizer, prompts_per_kind: int, max_new_tokens: int) -> list[dict]:
    """HF ``generate()`` of ``prompts_per_kind`` held-out chat and code prompts with each of two ``models``
    (name -> model), greedy, ``max_new_tokens`` each (EOS ignored): per prompt, whether the two agree token
    for token, the first token where they differ (None: nowhere) and each model's seconds."""
    from specserve.prompts.chat import heldout_prompts

    first_name, second_name = models
    prompts = [p for kind in ("chat", "code") for p in heldout_prompts(kind, prompts_per_kind)]
    greedy = []
    for p in tqdm(prompts, desc="greedy output", unit="prompt"):
        text = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        outs, secs = {}, {}
        for name, model in models.items():
            outs[name], secs[name] = hf_generate(model, ids, max_new_tokens)
        same = outs[first_name] == outs[second_name]
        pairs = enumerate(zip(outs[first_name], outs[second_name], strict=True))  # both ran max_new_tokens
        first = None if same else next(i for i, (a, b) in pairs if a != b)
        greedy.append({"prompt": p.name, "identical": same, "first_difference": first, "seconds": secs})
    return greedy


def measure(args: KernelsOptions) -> dict:
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
        **Header.of(args).to_json(),
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
        *md.command_block(data["command"]),
        "One target pass over k new positions after a 128-token context, warm KV cache, batch 1 (median of "
        f"{data['settings']['rounds']} rounds x {data['settings']['repeats']} timings, the two kernel paths "
        "alternating). A verify pass at gamma feeds k = gamma + 1 positions.",
        "",
        *md.table(
            ("k", "stock ms", "stock / its step", "oneDNN packed ms", "packed / its step", "packed / stock"),
            ((k, f"{stock[k]:.1f}", f"{stock[k] / stock['1']:.2f}x", f"{fast[k]:.1f}", f"{fast[k] / fast['1']:.2f}x",
              f"{fast[k] / stock[k]:.2f}")
             for k in stock),
        ),
    ]  # fmt: skip
    hf = {name: sum(g["seconds"][name] for g in data["greedy"]) for name in ("stock", "onednn")}
    tokens = data["max_new_tokens"] * len(data["greedy"])
    same, greedy = md.greedy_line(data["greedy"], data["max_new_tokens"], "")
    greedy += " between the two kernel paths"
    if same != len(data["greedy"]):
        greedy += f" (first differences at {md.first_differences(data['greedy'])})"
    lines += [
        "",
        greedy + f"; {1000 * hf['stock'] / tokens:.1f} ms/token stock, {1000 * hf['onednn'] / tokens:.1f} packed.",
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
            *md.table(
                ("path", "ms per drafted token", "vs the plain step"),
                [
                    ("stock kernels, 16-row blocks", f"{step['stock']:.2f}", f"{step['stock'] / step['plain']:.2f}x"),
                    ("packed oneDNN, rows unpadded where the kernel allows (the draft's default)",
                     f"{step['onednn']:.2f}", f"{step['onednn'] / step['plain']:.2f}x"),
                    ("plain model step, 1 position (the cost model's draft step; not batch-invariant)",
                     f"{step['plain']:.2f}", "1.00x"),
                ],
            ),
            "",
        ]
    notes = data.get("notes")
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def main(opts: KernelsOptions) -> int:
    """``python -m benchmarks kernels``: ``<out>/kernels.json`` and ``kernels.md`` (the hand-written notes after
    the marker in an earlier kernels.md stay)."""
    opts.threads = opts.threads or torch.get_num_threads()
    data = measure(opts)
    old = opts.out / "kernels.md"
    if old.exists() and NOTES in old.read_text():  # the hand-written part after the marker stays
        data["notes"] = NOTES + old.read_text().split(NOTES, 1)[1]
    print(render(data))
    md.write(opts.out, "kernels", render(data), data)
    return 0
