"""The benchmark harness: every figure of the report from one run on one machine.

``python -m specserve.bench.harness`` (or ``specserve bench``) measures, side by side:

1. **Single stream** on held-out prompt sets (``--prompt-sets``; for a chat
   pair such as the default SmolLM2 pair: held-out chat questions, held-out code
   requests, and ``copy``, requests whose answer repeats code given in the
   prompt), greedy and temperature 0.7: Hugging Face ``generate()`` of the
   target alone, Hugging Face assisted generation (``assistant_model=`` the
   draft), Hugging Face prompt-lookup decoding (``prompt_lookup_num_tokens=8``),
   and specserve through the whole gRPC path with gamma = 0, fixed gamma in
   {1, 2, 4, 8}, the n-gram proposer and the adaptive policy (with the draft
   model, and with the n-gram proposer). Wall-clock per committed token, time
   to first token.
2. **Under load**: open-loop Poisson arrivals at several rates for gamma = 0,
   the best fixed gamma and adaptive: throughput, TTFT and inter-token latency
   p50/p99, queue delay, target forward passes and positions (the accelerator
   work), accepted tokens and wasted proposals.
3. **The bound**: the cost model's predicted speedup per gamma from the
   measured acceptance and measured draft / verify costs, and measured /
   predicted as the implementation's efficiency.
4. **Sampling modes** (``--sampling-modes``): acceptance and ms/token of the
   coupled mode against the optimal one at temperatures 0.7 and 1.0, and the
   verdict on the default (:mod:`specserve.bench.sampling_modes`).
   ``--only-sampling-modes`` runs this phase alone and writes
   ``<out>/sampling_modes.json`` and ``<out>/sampling_modes.md`` instead::

       specserve bench --only-sampling-modes --target DIR --draft DIR --out DIR

Raw figures go to ``<out>/bench.json``; ``specserve.bench.report`` renders the Markdown
report and the PNG plots from that file.

``--predicted-outputs`` runs another mode instead (``specserve/bench/prediction.py``):
ms per token with a prediction equal to the greedy continuation (and sent as
text, and half wrong) against gamma = 0, into ``<out>/prediction.json`` and
``prediction.md``; the full report renders the section too once the JSON is
there.

``--only-load`` runs the load sweep alone (gamma = 0, ``--load-fixed-gamma``
and adaptive on the first prompt set) into ``<out>/load.json``; the report's
load section, plots and checks then come from that file, with its own command.
Every load point is measured ``--load-repeats`` times, interleaved (see
:func:`load_sweep`), and the report gives the medians and, per rate, adaptive's
throughput over gamma = 0's within each repeat.

``--draft-scaling`` runs another mode instead (``specserve/bench/draft_scaling.py``):
draft and verify ms per round and throughput for 1..32 concurrent sessions,
with the draft's batching on and off, into ``<out>/draft_scaling.json``,
``draft_scaling.md`` and ``draft_scaling.png``; the full report renders the
section too once the JSON is there.

The stack the harness starts admits as many sessions as a load point sends
(no per-client cap), verifies up to 32 sessions per call and drafts up to
``--draft-batch`` per pass (1: no draft batching).
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specserve.bench import sampling_modes
from specserve.bench.costs import measure_costs
from specserve.bench.pair import ignore_eos, load_pair
from specserve.bench.prom import scrape
from specserve.bench.prompts import code_prompts, heldout_files
from specserve.engine import cpu_kernels
from specserve.launch.local import COLOCATED_DRAFT_THREADS
from specserve.runtime.config import CoordinatorSettings

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = "smollm2-135m-instruct"  # registered names (specserve.engine.model_registry), or directories
DEFAULT_DRAFT = "specserve-smollm2-draft"

#: specserve modes: name -> (gamma or None for adaptive, proposer (None: the server's default, the feature
#: head where the draft serves one), hybrid lookup, min_confidence; None for the server's defaults: the lookup
#: on, dynamic draft length at 0.4 under the adaptive policy and off at a fixed gamma). "specserve adaptive"
#: is what a request that sets nothing gets.
SPEC_MODES: dict[str, tuple[int | None, str | None, bool | None, float | None]] = {
    "specserve gamma=0": (0, "model", None, None),
    "specserve gamma=1": (1, "model", None, None),
    "specserve gamma=2": (2, "model", None, None),
    "specserve gamma=4": (4, "model", None, None),
    "specserve gamma=8": (8, "model", None, None),
    "specserve n-gram gamma=4": (4, "ngram", None, None),
    "specserve n-gram adaptive": (None, "ngram", None, None),
    "specserve adaptive, model only": (None, "model", False, None),
    "specserve adaptive, whole gamma": (None, "model", None, 0.0),
    "specserve adaptive, token draft": (None, "model", None, None),
    "specserve feature gamma=2": (2, "feature", None, None),
    "specserve feature gamma=4": (4, "feature", None, None),
    "specserve adaptive": (None, None, None, None),
}
#: The modes that need the draft tier to serve the feature head (left out where it does not).
HEAD_MODES = frozenset(m for m, (_, proposer, _, _) in SPEC_MODES.items() if proposer == "feature")
FIXED_GAMMAS = (1, 2, 4, 8)
#: HF prompt-lookup baselines: name -> ``prompt_lookup_num_tokens``. 16 is the coordinator's default
#: ``max_gamma``, the longest proposal the n-gram proposer may make (like for like); 8 as in earlier runs.
HF_LOOKUP: dict[str, int] = {"hf prompt lookup (8)": 8, "hf prompt lookup (16)": 16}
#: HF target-only with PyTorch's stock linear kernels, beside the baselines on the target's kernel path.
HF_STOCK = "hf target-only (stock kernels)"


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
    #: specserve's own account of the generation's rounds (GenerationStats): the Propose calls, the Verify
    #: calls, and the target's forward passes inside them, in seconds.
    draft_s: float = 0.0
    verify_s: float = 0.0
    forward_s: float = 0.0
    #: Of ``proposed`` and ``accepted``, the tokens an n-gram lookup in the coordinator drafted.
    lookup_proposed: int = 0
    lookup_accepted: int = 0
    #: Which pass over the prompts this run belongs to (``--single-repeats``), from 0.
    repeat: int = 0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.total_s / max(self.tokens, 1)


# --------------------------------------------------------------------------- Hugging Face baselines


def _hf_generate(
    model, ids: torch.Tensor, max_new: int, temperature: float, seed: int, assistant=None, lookup: int = 0
) -> Run:
    kwargs = {
        "max_new_tokens": max_new,
        "do_sample": temperature > 0,
        **ignore_eos(model),  # as specserve's ignore_eos runs
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    total = time.perf_counter() - start
    new = out[0, ids.shape[1] :].tolist()
    return Run("", "", "", temperature, len(new), total, float("nan"), token_ids=new)


# --------------------------------------------------------------------------- specserve through gRPC


async def _spec_generate(
    client,
    ids: list[int],
    max_new: int,
    temperature: float,
    seed: int,
    gamma: int | None,
    proposer: str | None,
    hybrid_lookup: bool | None = None,
    min_confidence: float | None = None,
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
        hybrid_lookup=hybrid_lookup,
        min_confidence=min_confidence,
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
        draft_s=stats.draft_ns / 1e9,
        verify_s=stats.verify_ns / 1e9,
        forward_s=stats.forward_ns / 1e9,
        lookup_proposed=stats.lookup_proposed_tokens,
        lookup_accepted=stats.lookup_accepted_tokens,
    )
    return run, stamps


# --------------------------------------------------------------------------- phases


async def single_stream(
    client,
    target,
    draft,
    prompts: dict[str, list[tuple[str, list[int]]]],
    temperatures,
    max_new: int,
    seed: int,
    stock_target=None,
    repeats: int = 1,
    only: Sequence[str] | None = None,
) -> list[Run]:
    """Every (prompt set, prompt, temperature) through every mode, one after another, ``repeats`` times.

    Each repeat goes over every prompt again, every other repeat with the modes in the reverse order,
    so that over an even number of repeats every mode sits as often early as late in a prompt's turn
    and the machine's drift within a turn falls on the HF baselines and on specserve alike.
    ``stock_target``: the target with PyTorch's stock kernels where ``target`` has packed ones
    (:mod:`specserve.engine.cpu_kernels`), run as one more baseline (:data:`HF_STOCK`). ``only``: run these
    modes alone (None: every mode).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: list[Run] = []
    jobs = [(s, p, t) for s, ps in prompts.items() for p in ps for t in temperatures]
    modes = ["hf target-only", *([HF_STOCK] if stock_target is not None else []), "hf assisted"]
    modes += [*HF_LOOKUP, *SPEC_MODES]
    if only is not None:
        modes = [m for m in modes if m in only]
    bar = tqdm(total=repeats * len(jobs) * len(modes), desc="single stream", unit="gen")
    for repeat in range(repeats):
        for set_name, (name, token_ids), temp in jobs:
            ids = torch.tensor([token_ids])
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                if mode == "hf target-only":
                    run = _hf_generate(target, ids, max_new, temp, seed)
                elif mode == HF_STOCK:
                    run = _hf_generate(stock_target, ids, max_new, temp, seed)
                elif mode == "hf assisted":
                    run = _hf_generate(target, ids, max_new, temp, seed, assistant=draft)
                elif mode in HF_LOOKUP:
                    run = _hf_generate(target, ids, max_new, temp, seed, lookup=HF_LOOKUP[mode])
                else:
                    gamma, proposer, lookup, confidence = SPEC_MODES[mode]
                    run, _ = await _spec_generate(
                        client, token_ids, max_new, temp, seed, gamma, proposer, lookup, confidence
                    )
                run.mode, run.prompt_set, run.prompt, run.repeat = mode, set_name, name, repeat
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
    repeat: int = 0


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
    metrics_url: str,
    repeat: int = 0,
) -> LoadPoint:
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration_s:
            break
        arrivals.append(t)
    positions0 = scrape(metrics_url, "specserve_target_positions_processed_total")
    passes0 = scrape(metrics_url, "specserve_target_forward_seconds_count")
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
        target_positions=int(scrape(metrics_url, "specserve_target_positions_processed_total") - positions0),
        target_forward_passes=int(scrape(metrics_url, "specserve_target_forward_seconds_count") - passes0),
        repeat=repeat,
    )


async def load_sweep(
    client, prompts: list[list[int]], modes: list[tuple[str, int | None]], args, metrics_url: str
) -> list[LoadPoint]:
    """Every (rate, mode) point ``args.load_repeats`` times, interleaved: each repeat sweeps the rates,
    and at each rate runs the modes one after another, starting from a different mode each time, so that
    the machine's drift between minutes falls on every mode alike. A point's arrivals (the Poisson
    schedule, its seed) are the same for every mode and repeat; only the machine's noise differs."""
    points: list[LoadPoint] = []
    bar = tqdm(total=args.load_repeats * len(modes) * len(args.rates), desc="load sweep", unit="point")
    for repeat in range(args.load_repeats):
        for i, rate in enumerate(args.rates):
            shift = (repeat + i) % len(modes)
            for mode, gamma in modes[shift:] + modes[:shift]:
                points.append(
                    await load_point(
                        client,
                        prompts,
                        rate,
                        args.load_duration_s,
                        args.load_max_new_tokens,
                        0.0,
                        gamma,
                        mode,
                        args.seed,
                        metrics_url,
                        repeat,
                    )
                )
                bar.update()
    bar.close()
    return points


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
    """Greedy specserve runs token-identical to HF target-only on the same prompt (same kernels), and
    to HF target-only with the stock kernels where that baseline ran."""

    def reference(mode: str) -> dict:
        return {(r.prompt_set, r.prompt): r.token_ids for r in runs if r.mode == mode and r.temperature == 0}

    ref, stock = reference("hf target-only"), reference(HF_STOCK)
    spec = [r for r in runs if r.temperature == 0 and r.mode.startswith("specserve")]
    out = {
        "identical": sum(r.token_ids == ref.get((r.prompt_set, r.prompt)) for r in spec),
        "total": len(spec),
    }
    if stock:
        out["identical_to_stock_kernels"] = sum(r.token_ids == stock.get((r.prompt_set, r.prompt)) for r in spec)
    return out


#: The A/A control of the load sweep (``--load-control``): gamma = 0 measured a second time.
LOAD_CONTROL = "specserve gamma=0 (again)"


def _load_modes(args, fixed_gamma: int) -> list[tuple[str, int | None]]:
    """The load sweep's modes: gamma 0, a fixed gamma, adaptive, and with ``--load-control`` gamma 0 again,
    whose ratio to the first is what the machine's noise alone does to a pair of points."""
    modes: list[tuple[str, int | None]] = [
        ("specserve gamma=0", 0),
        (f"specserve gamma={fixed_gamma}", fixed_gamma),
        ("specserve adaptive", None),
    ]
    return modes + ([(LOAD_CONTROL, 0)] if args.load_control else [])


async def _process_stack(args):
    """The stack under test, one process per role as in production and in ``specserve up`` (the roles
    share no GIL with each other or with the HF baselines, which run here while the stack waits), and
    the URL of the target's ``/metrics``, which load points read."""
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import free_port

    metrics_port = free_port()
    stack = await start_process_stack(
        target_model=str(args.target),
        draft_model=str(args.draft),
        redis_url=args.redis_url,
        # "fastest" reaches here only from --only-load; a target timing its kernels runs without invariance.
        target_overrides={"metrics_port": metrics_port, "kernels": args.kernels, "invariant": args.kernels != "fastest"},
        draft_overrides={"max_batch_size": args.draft_batch, **_head_overrides(args)},
        coordinator_overrides=_coordinator_overrides(args.draft_batch),
    )
    return stack, f"http://127.0.0.1:{metrics_port}/metrics"


def _head_overrides(args) -> dict[str, str]:
    """The draft's feature head as ``--head`` names it ('auto': the default pair's head when the draft is the
    default draft and the head is present; 'none': no head)."""
    from specserve.engine import model_registry
    from specserve.engine.models import resolve_model_path

    head = args.head
    if head == "auto":
        source = model_registry.REGISTRY.get(model_registry.DEFAULT_HEAD)
        default_draft = Path(resolve_model_path(DEFAULT_DRAFT, "draft")) == Path(args.draft)
        head = model_registry.DEFAULT_HEAD if default_draft and source is not None and source.present() else "none"
    return {"feature_head": head, "feature_head_target": str(args.target)} if head != "none" else {"feature_head": "none"}


def _served_modes(args) -> list[str]:
    """Every single-stream mode the stack under test can serve (the head's only where the draft serves one)."""
    heads = _head_overrides(args).get("feature_head", "none") != "none"
    modes = ["hf target-only", HF_STOCK, "hf assisted", *HF_LOOKUP, *SPEC_MODES]
    return [m for m in modes if heads or m not in HEAD_MODES]


async def _warm_up(client) -> None:
    """One short generation per mode family."""
    for gamma in (0, 4, None):
        await _spec_generate(client, [1, 2, 3], 8, 0.0, 0, gamma, "model")
    await _spec_generate(client, [1, 2, 3], 8, 0.0, 0, 4, None)  # the server's default proposer


async def run_single_only(args) -> dict:
    """``--only-single``: the single-stream table alone, for ``--single-modes`` (default: every mode), each
    mode's median ms per token against gamma 0 through the same service and against HF assisted generation."""
    torch.manual_seed(args.seed)
    tokenizer, target, draft = load_pair(args.target, args.draft, kernels=args.kernels)
    args.kernels = cpu_kernels.path_of(target)
    names = args.prompt_sets or sampling_modes.default_prompt_sets(tokenizer)
    prompts = sampling_modes.load_prompt_sets(names, tokenizer, args.target, args.prompts, args.prompt_chars)
    heads = _head_overrides(args).get("feature_head", "none") != "none"
    only = [m for m in (args.single_modes or _served_modes(args)) if heads or m not in HEAD_MODES]
    stack, _ = await _process_stack(args)
    try:
        from specserve.client import AsyncClient

        async with AsyncClient(stack.address, timeout=600) as client:
            await _warm_up(client)
            runs = await single_stream(
                client, target, draft, prompts, args.temperatures, args.max_new_tokens, args.seed,
                repeats=args.single_repeats, only=only,
            )
    finally:
        await stack.stop()
    return {
        **_run_header(args),
        "feature_head": heads,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "single_stream": summarize_single(runs),
        "greedy_identity": greedy_identity(runs),
        "runs": [asdict(r) | {"ms_per_token": r.ms_per_token} for r in runs],
    }


async def run_load_only(args) -> dict:
    """``--only-load``: the load sweep alone (gamma 0, ``--load-fixed-gamma``, adaptive) on the first
    prompt set, for ``<out>/load.json``."""
    from transformers import AutoTokenizer

    from specserve.client import AsyncClient

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    first = (args.prompt_sets or sampling_modes.default_prompt_sets(tokenizer))[0]
    named = sampling_modes.load_prompt_sets([first], tokenizer, args.target, args.prompts, args.prompt_chars)
    modes = _load_modes(args, args.load_fixed_gamma)
    stack, metrics_url = await _process_stack(args)
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            await _warm_up(client)
            load = await load_sweep(client, [ids for _, ids in named[first]], modes, args, metrics_url)
    finally:
        await stack.stop()
    return {
        **_run_header(args),
        "prompt_set": first,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load": [asdict(p) for p in load],
    }


async def run_all(args) -> dict:
    from specserve.client import AsyncClient

    torch.manual_seed(args.seed)
    tokenizer, target, draft = load_pair(args.target, args.draft, kernels=args.kernels)
    kernels = cpu_kernels.path_of(target)
    args.kernels = kernels  # "fastest" timed here: the service's target runs the path HF runs
    stock_target = load_pair(args.target, args.draft)[1] if kernels == "onednn" else None

    names = args.prompt_sets or sampling_modes.default_prompt_sets(tokenizer, copy=True)
    prompts = sampling_modes.load_prompt_sets(names, tokenizer, args.target, args.prompts, args.prompt_chars)
    heldout_ok = all(n in ("chat", "chat-code", "copy") for n in names) or heldout_files(args.target)[1]
    costs = measure_costs(target, draft, repeats=args.cost_repeats, draft_threads=COLOCATED_DRAFT_THREADS)

    stack, metrics_url = await _process_stack(args)
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            await _warm_up(client)
            runs = await single_stream(
                client,
                target,
                draft,
                prompts,
                args.temperatures,
                args.max_new_tokens,
                args.seed,
                stock_target=stock_target,
                repeats=args.single_repeats,
                only=_served_modes(args),
            )
            summary = summarize_single(runs)
            first = next(
                iter(prompts)
            )  # the fixed gamma for the load sweep: the best on the first set, greedy
            greedy_code = summary.get(f"{first} T=0", {})
            best_fixed = min(
                FIXED_GAMMAS,
                key=lambda g: greedy_code.get(f"specserve gamma={g}", {}).get(
                    "ms_per_token_median", float("inf")
                ),
            )
            load_prompts = [ids for _, ids in prompts[first]]
            modes = _load_modes(args, best_fixed)
            load = await load_sweep(client, load_prompts, modes, args, metrics_url)
            comparison = (
                await sampling_modes.run_phase(client, tokenizer, args) if args.sampling_modes else None
            )
    finally:
        await stack.stop()

    return {
        "command": args.command,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": _machine(),
        "models": {"target": str(args.target), "draft": str(args.draft)},
        "kernels": kernels,
        "attention": target.config._attn_implementation,  # the workers' (specserve.engine.attention), here and there
        "decode_steps": CoordinatorSettings.model_fields["decode_steps"].default,
        "heldout_prompts": heldout_ok,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "costs": asdict(costs),
        "single_stream": summary,
        "greedy_identity": greedy_identity(runs),
        "runs": [asdict(r) | {"ms_per_token": r.ms_per_token} for r in runs],
        "best_fixed_gamma": best_fixed,
        "load": [asdict(p) for p in load],
        **({"sampling_modes": comparison} if comparison is not None else {}),
    }


def _run_header(args) -> dict:
    """What every benchmark's JSON starts with: the command, when, the machine, the pair (the target
    alone for a benchmark without a draft)."""
    header = {
        "command": args.command,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": _machine(),
        "target": str(args.target),
    }
    if getattr(args, "draft", None) is not None:
        header["draft"] = str(args.draft)
    return header


def _machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _coordinator_overrides(draft_batch: int) -> dict:
    """Settings of the benchmark's coordinator: no admission cap below what a load point sends."""
    return {
        "max_sessions": 4096,
        "max_sessions_per_client": 4096,
        "max_batch_size": 32,
        "draft_max_batch_size": draft_batch,
    }


def _code_prompts(args, tokenizer, n: int) -> tuple[list[tuple[str, list[int]]], bool]:
    """``n`` held-out code prompts as (name, token ids), and whether they are held out: the held-out
    code requests through the chat template for a chat pair, else cuts of held-out stdlib files."""
    if getattr(tokenizer, "chat_template", None):
        return sampling_modes.load_prompt_sets(["chat-code"], tokenizer, args.target, n, args.prompt_chars)[
            "chat-code"
        ], True
    files, heldout_ok = heldout_files(args.target)
    return [
        (p.name, tokenizer(p.text).input_ids) for p in code_prompts(files, n, max_chars=args.prompt_chars)
    ], heldout_ok


async def run_draft_scaling(args) -> dict:
    from transformers import AutoTokenizer

    from specserve.bench.draft_scaling import measure, to_json

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    named, heldout_ok = _code_prompts(args, tokenizer, 8)
    prompts = [ids for _, ids in named]
    sessions = tuple(args.sessions)
    bar = tqdm(total=2 * len(sessions) * args.scaling_repeats, desc="draft scaling", unit="point")
    runs = await measure(
        target=args.target,
        draft=args.draft,
        redis_url=args.redis_url,
        prompts=prompts,
        sessions=sessions,
        gamma=args.scaling_gamma,
        max_new_tokens=args.scaling_max_new_tokens,
        repeats=args.scaling_repeats,
        draft_batch=args.draft_batch if args.draft_batch > 1 else 32,
        progress=bar.update,
    )
    bar.close()
    settings = {
        "command": args.command,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "platform": platform.platform(),
        "cpus": torch.get_num_threads(),
        "target": str(args.target),
        "draft": str(args.draft),
        "heldout_prompts": heldout_ok,
        "sessions": list(sessions),
        "gamma": args.scaling_gamma,
        "max_new_tokens": args.scaling_max_new_tokens,
        "repeats": args.scaling_repeats,
        "draft_batch": args.draft_batch if args.draft_batch > 1 else 32,
    }
    return to_json(runs, settings)


async def run_latency(args) -> dict:
    from transformers import AutoTokenizer

    from specserve.bench.latency import measure, tier_cpus, to_json

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    sets = args.prompt_sets or sampling_modes.default_prompt_sets(tokenizer)
    prompts = sampling_modes.load_prompt_sets(
        sets[:1], tokenizer, args.target, args.latency_prompts, args.prompt_chars
    )
    prompts_list = next(iter(prompts.values()))
    total = len(args.latency_sides) * len(args.rtts_ms) * 5 * len(prompts_list) * args.latency_repeats
    bar = tqdm(total=total, desc="latency", unit="gen")
    cpus = tier_cpus(args.latency_cores == "separate")
    runs = await measure(
        target=args.target,
        draft=args.draft,
        redis_url=args.redis_url,
        prompts=prompts_list,
        rtts_ms=tuple(args.rtts_ms),
        sides=tuple(args.latency_sides),
        fixed_gamma=args.latency_gamma,
        max_new_tokens=args.latency_max_new_tokens,
        repeats=args.latency_repeats,
        cpus=cpus,
        progress=bar.update,
    )
    bar.close()
    settings = {
        **_run_header(args),
        "prompt_set": next(iter(prompts)),
        "prompts": len(prompts_list),
        "rtts_ms": list(args.rtts_ms),
        "sides": list(args.latency_sides),
        "max_new_tokens": args.latency_max_new_tokens,
        "fixed_gamma": args.latency_gamma,
        "repeats": args.latency_repeats,
        "cpus": None if cpus is None else {role: sorted(c) for role, c in cpus.items()},
    }
    return to_json(runs, settings)


async def run_prediction(args) -> dict:
    from transformers import AutoTokenizer

    from specserve.bench.prediction import measure, to_json

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    prompts, heldout_ok = _code_prompts(args, tokenizer, args.prediction_prompts)
    bar = tqdm(total=5 * len(prompts) * args.prediction_repeats, desc="predicted outputs", unit="gen")
    runs, gamma = await measure(
        target=args.target,
        draft=args.draft,
        redis_url=args.redis_url,
        prompts=prompts,
        tokenizer=tokenizer,
        max_new_tokens=args.prediction_max_new_tokens,
        block=args.prediction_block,
        repeats=args.prediction_repeats,
        progress=bar.update,
    )
    bar.close()
    settings = {
        **_run_header(args),
        "heldout_prompts": heldout_ok,
        "prompts": len(prompts),
        "max_new_tokens": args.prediction_max_new_tokens,
        "block": args.prediction_block,
        "repeats": args.prediction_repeats,
        "fixed_gamma": gamma,
    }
    return to_json(runs, settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a registered model name or a directory")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="a registered model name or a directory")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument(
        "--prompt-sets",
        nargs="+",
        choices=sampling_modes.PROMPT_SETS,
        default=None,
        help="held-out prompt sets (default: chat chat-code copy with a chat template, else code prose)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--single-repeats",
        type=int,
        default=1,
        help="passes over the single-stream prompts, every other one with the modes in the reverse order "
        "(medians are over prompts and passes)",
    )
    parser.add_argument(
        "--prompt-chars", type=int, default=600, help="characters of each prompt (code, prose)"
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, 16.0])
    parser.add_argument("--load-duration-s", type=float, default=15.0)
    parser.add_argument("--load-max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--load-repeats",
        type=int,
        default=3,
        help="measure every load point this many times, interleaved; the report gives medians",
    )
    parser.add_argument(
        "--only-single",
        action="store_true",
        help="run only the single-stream table (of --single-modes); writes single.json and single.md",
    )
    parser.add_argument(
        "--single-modes",
        nargs="+",
        default=None,
        help="the single-stream modes to run (names as in the table; default: all)",
    )
    parser.add_argument(
        "--head",
        default="auto",
        help="the draft's feature head: a registered name or directory, 'none', or 'auto' (the default pair's "
        "head with the default draft)",
    )
    parser.add_argument(
        "--only-load",
        action="store_true",
        help="run only the load sweep (gamma 0, --load-fixed-gamma, adaptive); writes load.json, which the "
        "report's load section and checks then use",
    )
    parser.add_argument("--load-fixed-gamma", type=int, default=4, help="the fixed gamma of --only-load")
    parser.add_argument(
        "--load-control",
        action="store_true",
        help="measure gamma 0 twice at every load point (an A/A control: the spread of its ratio is the noise "
        "a comparison of two modes has to clear)",
    )
    parser.add_argument("--cost-repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kernels",
        choices=("fastest", "auto", "stock", "onednn"),
        default="auto",
        help="the target's linear-layer kernels (specserve/engine/cpu_kernels.py), in the target service (with "
        "its default invariant passes) and in the Hugging Face baselines (stock transformers) alike; auto (the "
        "target's default): packed where it applies; fastest: both paths timed here as the pair loads and the "
        "faster one given to the service too (--only-load, which loads no baselines: the service times them "
        "itself, with invariance off); where the path is onednn, HF target-only with the stock kernels runs too",
    )
    lat = parser.add_argument_group("network latency between the tiers (specserve/bench/latency.py)")
    lat.add_argument(
        "--latency",
        action="store_true",
        help="run only the latency mode: RTTs injected to the draft, then to the target; writes latency.json",
    )
    lat.add_argument("--rtts-ms", type=float, nargs="+", default=[0.0, 2.0, 10.0])
    lat.add_argument("--latency-prompts", type=int, default=3, help="held-out prompts (the first set)")
    lat.add_argument("--latency-max-new-tokens", type=int, default=64)
    lat.add_argument(
        "--latency-gamma",
        type=int,
        default=1,
        help="the fixed gamma run with and without overlap (a round drafted ahead is used only when every "
        "proposed token is accepted and the bonus token guessed: about alpha^gamma x P(guess))",
    )
    lat.add_argument(
        "--latency-repeats", type=int, default=2, help="times each setting runs each prompt, interleaved"
    )
    lat.add_argument(
        "--latency-sides",
        nargs="+",
        choices=("draft", "target"),
        default=["draft", "target"],
        help="the tiers put behind the delay, one after the other",
    )
    lat.add_argument(
        "--latency-cores",
        choices=("separate", "shared"),
        default="separate",
        help="separate: the draft tier and the coordinator on the first CPU, the target on the others (tiers "
        "on machines of their own; needs 2 CPUs); shared: every role on every core",
    )
    modes = parser.add_argument_group("sampling modes (coupled against optimal, specserve/bench/sampling_modes.py)")
    modes.add_argument("--sampling-modes", action="store_true", help="add the sampling-mode comparison")
    modes.add_argument(
        "--only-sampling-modes",
        action="store_true",
        help="run only the comparison; writes sampling_modes.json and sampling_modes.md to --out",
    )
    modes.add_argument(
        "--mode-prompt-sets",
        nargs="+",
        choices=sampling_modes.PROMPT_SETS,
        default=None,
        help="held-out prompt sets (default: chat chat-code with a chat template, else code prose)",
    )
    modes.add_argument("--mode-prompts", type=int, default=8, help="prompts per set")
    modes.add_argument(
        "--mode-temperatures", type=float, nargs="+", default=list(sampling_modes.TEMPERATURES)
    )
    modes.add_argument(
        "--mode-gammas", nargs="+", default=list(sampling_modes.GAMMAS), help="'auto' (adaptive) or integers"
    )
    modes.add_argument("--mode-max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--draft-batch", type=int, default=32, help="sessions the draft drafts per pass (1: batching off)"
    )
    parser.add_argument(
        "--draft-scaling",
        action="store_true",
        help="run only the draft-scaling mode: 1..32 concurrent sessions, draft batching on and off",
    )
    predicted = parser.add_argument_group("Predicted Outputs (specserve/bench/prediction.py)")
    predicted.add_argument(
        "--predicted-outputs",
        action="store_true",
        help="run only the Predicted Outputs mode: a prediction equal to the greedy continuation (and half "
        "wrong) against gamma = 0; writes prediction.json and prediction.md to --out",
    )
    predicted.add_argument("--prediction-prompts", type=int, default=4, help="held-out code prompts")
    predicted.add_argument("--prediction-max-new-tokens", type=int, default=128)
    predicted.add_argument(
        "--prediction-block", type=int, default=16, help="half-wrong: every other block of this many tokens"
    )
    predicted.add_argument("--prediction-repeats", type=int, default=1)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--scaling-gamma", type=int, default=4)
    parser.add_argument("--scaling-max-new-tokens", type=int, default=48)
    parser.add_argument("--scaling-repeats", type=int, default=1)
    args = parser.parse_args(argv)
    args.command = " ".join(["python -m specserve.bench.harness", *(sys.argv[1:] if argv is None else argv)])
    for g in args.mode_gammas:
        if g != "auto" and not g.isdigit():
            parser.error(f"--mode-gammas takes 'auto' or integers >= 0, got {g!r}")
    if args.draft_batch < 1:
        parser.error("--draft-batch must be >= 1")
    if args.load_repeats < 1:
        parser.error("--load-repeats must be >= 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from specserve.engine.models import resolve_model_path

    # A registered name (fetched once into the cache), a directory or a hub id: from here on, a directory.
    args.target = Path(resolve_model_path(str(args.target), "target"))
    args.draft = Path(resolve_model_path(str(args.draft), "draft"))

    from specserve.bench import report
    from specserve.launch.redis_server import private_redis
    from specserve.runtime.logs import configure_logging

    configure_logging("console", "warning")  # per-round debug events would be timed too

    async def go(run):
        with private_redis(args.redis_url) as url:
            args.redis_url = url
            if args.only_sampling_modes:
                return {
                    "command": args.command,
                    "machine": _machine(),
                    **await sampling_modes.run_only(args),
                }
            return await run(args)

    # A mode of its own writes <name>.json and its section alone as <name>.md; README.md is left alone
    # (it may carry analysis added by hand): the next full run or `python -m specserve.bench.report <out>` renders
    # the section into it.
    separate = [
        (args.latency, run_latency, "latency", report.write_latency),
        (args.predicted_outputs, run_prediction, "prediction", report.write_prediction),
        (args.only_load, run_load_only, "load", report.write_load),
        (args.only_single, run_single_only, "single", report.write_single),
        (args.draft_scaling, run_draft_scaling, "draft_scaling", report.write_draft_scaling),
    ]
    for chosen, run, name, write in separate:
        if chosen:
            data = asyncio.run(go(run))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {args.out / f'{name}.json'} and {write(data, args.out)}")
            return 0
    data = asyncio.run(go(run_all))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only_sampling_modes:
        for path in sampling_modes.write(data, args.out):
            print(f"wrote {path}")
        return 0
    (args.out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
    for older in ("load.json", "load.md"):  # this run's own sweep supersedes an --only-load run's
        (args.out / older).unlink(missing_ok=True)
    report.write_report(data, args.out)
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
