"""The harness's modes through the stack under test: single stream, the load sweep and the full run.

``specserve bench all`` (:func:`bench_all`) measures, side by side, every figure of the report
(docs/benchmarks/README.md) in one run on one machine:

1. **Single stream** on held-out prompt sets (``--prompt-sets``; for a chat pair such as the default SmolLM2
   pair: held-out chat questions, held-out code requests, and ``copy``, requests whose answer repeats code
   given in the prompt), greedy and temperature 0.7: Hugging Face ``generate()`` of the target alone, Hugging
   Face assisted generation (``assistant_model=`` the draft), Hugging Face prompt-lookup decoding, and
   specserve through the whole gRPC path in every mode of :mod:`specserve.bench.modes`. Wall-clock per
   committed token, time to first token.
2. **Under load**: open-loop Poisson arrivals at several rates for gamma = 0, the best fixed gamma,
   adaptive and, where the draft serves one, the feature head at ``--head-gamma``: throughput, TTFT and inter-token latency p50/p99, queue delay, target forward passes and
   positions (the accelerator work), accepted tokens and wasted proposals, and for the head the feature
   bytes the coordinator relayed (:class:`specserve.bench.prom.FeatureBytes`) with the projections of
   :mod:`specserve.bench.head_projection` (as for the single-stream modes that drafted with it). Every point
   is measured ``--load-repeats`` times, interleaved (:func:`load_sweep`).
3. **The bound**: the cost model's predicted speedup per gamma from the measured acceptance and measured
   draft / verify costs, and measured / predicted as the implementation's efficiency
   (:mod:`specserve.bench.report`).

``specserve bench single`` and ``specserve bench load`` run the first and the second alone, into
``single.json`` and ``load.json`` (the report's load section then comes from the latter; ``load --name
load_<x>`` keeps a further sweep beside it).

The stack the harness starts admits as many sessions as a load point sends (no per-client cap), verifies up
to 32 sessions per call and drafts up to ``--draft-batch`` per pass (1: no draft batching).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specserve.bench import report
from specserve.bench.costs import Costs, measure_costs
from specserve.bench.head_projection import run_figures
from specserve.bench.modes import (
    BY_NAME,
    FIXED_GAMMAS,
    GAMMA0,
    HEAD_MODES,
    HF_ASSISTED,
    HF_LOOKUP,
    HF_STOCK,
    HF_TARGET,
    LOAD_ADAPTIVE,
    SINGLE_MODES,
    SpecMode,
    fixed,
    load_modes,
    may_use_head,
)
from specserve.bench.options import (
    FullOptions,
    LatencyOptions,
    LoadOptions,
    PromptOptions,
    SingleOptions,
    StackOptions,
)
from specserve.bench.pair import hf_generate, load_pair
from specserve.bench.prom import FeatureBytes, scrape
from specserve.bench.prompts import default_prompt_sets, heldout_files, load_prompt_sets
from specserve.bench.runner import Header, head_gamma_or_reason, head_info, head_overrides, run_mode
from specserve.bench.timing import Stopwatch, inter_token_latencies, timed_stream
from specserve.engine import cpu_kernels
from specserve.launch.local import COLOCATED_DRAFT_THREADS
from specserve.runtime.config import CoordinatorSettings


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
    #: Which pass over the prompts this run belongs to (``--single-repeats``, ``--repeats``), from 0.
    repeat: int = 0
    #: Rounds that proposed at least one draft token (GenerationStats.draft_rounds).
    draft_rounds: int = 0
    #: Bytes of the target's features the coordinator relayed during this run, by hop (its
    #: ``specserve_coordinator_feature_bytes_total``; 0 for a mode that cannot draft with the feature head).
    feature_bytes_to_draft: int = 0
    feature_bytes_from_target: int = 0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.total_s / max(self.tokens, 1)


# --------------------------------------------------------------------------- Hugging Face baselines


def _hf_generate(
    model, ids: list[int], max_new: int, temperature: float, seed: int, assistant=None, lookup: int = 0
) -> Run:
    extra = {"assistant_model": assistant} if assistant is not None else {}
    if lookup:
        extra["prompt_lookup_num_tokens"] = lookup
    new, total = hf_generate(model, ids, max_new, temperature, seed, **extra)
    return Run("", "", "", temperature, len(new), total, float("nan"), token_ids=new)


# --------------------------------------------------------------------------- specserve through gRPC


async def _spec_generate(
    client, ids: list[int], max_new: int, temperature: float, seed: int, mode: SpecMode
) -> tuple[Run, list[tuple[float, int]]]:
    """One streamed generation in ``mode``; returns the run and (arrival time, size) of each chunk."""
    stream = client.stream(
        prompt_token_ids=ids,
        max_new_tokens=max_new,
        temperature=temperature,
        seed=seed,
        ignore_eos=True,
        **mode.request(),
    )
    streamed = await timed_stream(stream)
    stats, tokens = streamed.stats, streamed.token_ids
    run = Run(
        "",
        "",
        "",
        temperature,
        len(tokens),
        streamed.seconds,
        streamed.first_token_s,
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
        draft_rounds=stats.draft_rounds,
    )
    return run, streamed.stamps


async def _spec_generate_counted(
    client: Any, ids: list[int], max_new: int, temperature: float, seed: int, mode: SpecMode,
    coordinator_metrics: str | None,
) -> Run:
    """:func:`_spec_generate` alone on the stack, with the feature bytes the coordinator relayed for it (read
    before and after, outside the timing; only for a mode that may use the head)."""
    metrics = coordinator_metrics if may_use_head(mode) else None
    before = FeatureBytes.read(metrics)
    run, _ = await _spec_generate(client, ids, max_new, temperature, seed, mode)
    relayed = FeatureBytes.read(metrics) - before
    run.feature_bytes_to_draft, run.feature_bytes_from_target = relayed.to_draft, relayed.from_target
    return run


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
    coordinator_metrics: str | None = None,
) -> list[Run]:
    """Every (prompt set, prompt, temperature) through every mode, one after another, ``repeats`` times.

    Each repeat goes over every prompt again, every other repeat with the modes in the reverse order,
    so that over an even number of repeats every mode sits as often early as late in a prompt's turn
    and the machine's drift within a turn falls on the HF baselines and on specserve alike.
    ``stock_target``: the target with PyTorch's stock kernels where ``target`` has packed ones
    (:mod:`specserve.engine.cpu_kernels`), run as one more baseline (:data:`HF_STOCK`). ``only``: run these
    modes alone (None: every mode). ``coordinator_metrics``: the coordinator's ``/metrics``, whose
    feature-byte counters each run that may use the head reads (:class:`FeatureBytes`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: list[Run] = []
    jobs = [(s, p, t) for s, ps in prompts.items() for p in ps for t in temperatures]
    modes = [m for m in SINGLE_MODES if m != HF_STOCK or stock_target is not None]
    if only is not None:
        modes = [m for m in modes if m in only]
    bar = tqdm(total=repeats * len(jobs) * len(modes), desc="single stream", unit="gen")
    for repeat in range(repeats):
        for set_name, (name, token_ids), temp in jobs:
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                if mode == HF_TARGET:
                    run = _hf_generate(target, token_ids, max_new, temp, seed)
                elif mode == HF_STOCK:
                    run = _hf_generate(stock_target, token_ids, max_new, temp, seed)
                elif mode == HF_ASSISTED:
                    run = _hf_generate(target, token_ids, max_new, temp, seed, assistant=draft)
                elif mode in HF_LOOKUP:
                    run = _hf_generate(target, token_ids, max_new, temp, seed, lookup=HF_LOOKUP[mode])
                else:
                    run = await _spec_generate_counted(
                        client, token_ids, max_new, temp, seed, BY_NAME[mode], coordinator_metrics
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
    draft_rounds: int = 0
    #: Bytes of the target's features the coordinator relayed during the point, by hop (:class:`FeatureBytes`).
    feature_bytes_to_draft: int = 0
    feature_bytes_from_target: int = 0


async def load_point(
    client,
    prompts: list[list[int]],
    rate: float,
    duration_s: float,
    max_new: int,
    temperature: float,
    mode: SpecMode,
    seed: int,
    metrics_url: str,
    repeat: int = 0,
    coordinator_metrics: str | None = None,
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
    features0 = FeatureBytes.read(coordinator_metrics if may_use_head(mode) else None)
    results: list[tuple[Run, list[tuple[float, int]]] | BaseException] = []
    clock = Stopwatch()

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, at - clock.elapsed()))
        try:
            results.append(
                await _spec_generate(client, prompts[i % len(prompts)], max_new, temperature, seed + i, mode)
            )
        except Exception as exc:  # counted, reported
            results.append(exc)

    with clock:
        await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    elapsed = clock.seconds
    ok = [r for r in results if not isinstance(r, BaseException)]
    ttft = [r.first_token_s for r, _ in ok]
    # Inter-token latency as a reader sees it: a chunk's gap since the previous
    # chunk, spread over the chunk's tokens.
    itl = [x for _, st in ok for x in inter_token_latencies(st)]
    queue = [r.queue_s / max(r.rounds, 1) for r, _ in ok]
    committed = sum(r.tokens for r, _ in ok)
    proposed = sum(r.proposed for r, _ in ok)
    accepted = sum(r.accepted for r, _ in ok)
    relayed = FeatureBytes.read(coordinator_metrics if may_use_head(mode) else None) - features0

    def q(xs, p):
        return float(np.percentile(xs, p)) if xs else float("nan")

    return LoadPoint(
        mode=mode.name,
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
        draft_rounds=sum(r.draft_rounds for r, _ in ok),
        feature_bytes_to_draft=relayed.to_draft,
        feature_bytes_from_target=relayed.from_target,
    )


@dataclass
class Sweep:
    """A load sweep's settings: the arrival rates (requests/s), seconds of arrivals per point, tokens per
    request, the times every point is measured, and the seed of the arrivals and requests."""

    rates: list[float]
    duration_s: float
    max_new_tokens: int
    repeats: int
    seed: int


async def load_sweep(
    client, prompts: list[list[int]], modes: list[SpecMode], sweep: Sweep, metrics: StackMetrics
) -> list[LoadPoint]:
    """Every (rate, mode) point ``sweep.repeats`` times, interleaved: each repeat sweeps the rates,
    and at each rate runs the modes one after another, starting from a different mode each time, so that
    the machine's drift between minutes falls on every mode alike. A point's arrivals (the Poisson
    schedule, its seed) are the same for every mode and repeat; only the machine's noise differs."""
    points: list[LoadPoint] = []
    bar = tqdm(total=sweep.repeats * len(modes) * len(sweep.rates), desc="load sweep", unit="point")
    for repeat in range(sweep.repeats):
        for i, rate in enumerate(sweep.rates):
            shift = (repeat + i) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                points.append(
                    await load_point(
                        client,
                        prompts,
                        rate,
                        sweep.duration_s,
                        sweep.max_new_tokens,
                        0.0,
                        mode,
                        sweep.seed,
                        metrics.target,
                        repeat,
                        metrics.coordinator,
                    )
                )
                bar.update()
    bar.close()
    return points


# --------------------------------------------------------------------------- summaries


@dataclass
class ModeSummary:
    """One mode's single-stream figures over a (prompt set, temperature): ms per committed token (median and
    quartiles over prompts and passes), acceptance (accepted / proposed draft tokens) and tokens per round
    (None where the mode proposes nothing), and the runs they are over."""

    ms_per_token_median: float
    ms_per_token_q1: float
    ms_per_token_q3: float
    acceptance: float | None
    tokens_per_round: float | None
    n: int
    #: Where the runs relayed features (the head drafted): bytes per committed token and the projections
    #: (:class:`specserve.bench.head_projection.HeadFigures`); None elsewhere.
    head: dict[str, Any] | None = None

    @classmethod
    def of(cls, runs: list[Run], head: dict[str, Any] | None = None) -> ModeSummary:
        """``head``: the served head (:func:`specserve.bench.runner.head_info`), for the head figures."""
        xs = [r.ms_per_token for r in runs]
        proposed, rounds = sum(r.proposed for r in runs), sum(r.rounds for r in runs)
        return cls(
            ms_per_token_median=statistics.median(xs),
            ms_per_token_q1=float(np.percentile(xs, 25)),
            ms_per_token_q3=float(np.percentile(xs, 75)),
            acceptance=sum(r.accepted for r in runs) / proposed if proposed else None,
            tokens_per_round=sum(r.tokens for r in runs) / rounds if rounds else None,
            n=len(xs),
            head=run_figures(runs, head),
        )


#: ``"<prompt set> T=<temperature>"`` -> mode -> its summary, in the order the modes ran.
SingleSummary = dict[str, dict[str, ModeSummary]]


def summarize_single(runs: list[Run], head: dict[str, Any] | None = None) -> SingleSummary:
    """Medians and quartiles of ms/token per (prompt set, temperature, mode); ``head``: the served head, for
    the head figures of the modes that drafted with it."""
    out: SingleSummary = {}
    for set_name, temp in sorted({(r.prompt_set, r.temperature) for r in runs}):
        group = {}
        for mode in dict.fromkeys(r.mode for r in runs):
            sel = [r for r in runs if (r.prompt_set, r.temperature, r.mode) == (set_name, temp, mode)]
            if sel:
                group[mode] = ModeSummary.of(sel, head)
        out[f"{set_name} T={temp:g}"] = group
    return out


@dataclass
class GreedyIdentity:
    """Greedy specserve runs token-identical to ``reference`` on the same prompt, of all: HF target-only (same
    kernels) where it ran, else specserve at gamma 0 through the same service (a run of specserve modes alone,
    ``--modes``); and to HF target-only with the stock kernels where that baseline ran (None where it did not)."""

    identical: int
    total: int
    identical_to_stock_kernels: int | None = None
    reference: str = HF_TARGET

    @classmethod
    def of(cls, runs: list[Run]) -> GreedyIdentity:
        def reference(mode: str) -> dict:
            return {(r.prompt_set, r.prompt): r.token_ids for r in runs if r.mode == mode and r.temperature == 0}

        name = HF_TARGET if any(r.mode == HF_TARGET for r in runs) else GAMMA0.name
        ref, stock = reference(name), reference(HF_STOCK)
        spec = [r for r in runs if r.temperature == 0 and r.mode in BY_NAME and r.mode != name]
        same = sum(r.token_ids == ref.get((r.prompt_set, r.prompt)) for r in spec)
        to_stock = sum(r.token_ids == stock.get((r.prompt_set, r.prompt)) for r in spec) if stock else None
        return cls(same, len(spec), to_stock, name)

    def to_json(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _runs_json(runs: list[Run]) -> list[dict[str, Any]]:
    return [asdict(r) | {"ms_per_token": r.ms_per_token} for r in runs]


def _single_json(summary: SingleSummary) -> dict[str, dict[str, dict[str, Any]]]:
    return {key: {mode: asdict(s) for mode, s in group.items()} for key, group in summary.items()}


@dataclass
class SingleRun:
    """``single.json``: the single-stream table alone (``specserve bench single``)."""

    header: Header
    feature_head: bool
    settings: dict[str, Any]
    single_stream: SingleSummary
    greedy_identity: GreedyIdentity
    runs: list[Run]
    #: The served head (:func:`specserve.bench.runner.head_info`; None: none).
    head: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.header.to_json(),
            "feature_head": self.feature_head,
            "head": self.head,
            "settings": self.settings,
            "single_stream": _single_json(self.single_stream),
            "greedy_identity": self.greedy_identity.to_json(),
            "runs": _runs_json(self.runs),
        }


@dataclass
class LoadRun:
    """``load.json``: the load sweep alone (``specserve bench load``) on one prompt set."""

    header: Header
    prompt_set: str
    settings: dict[str, Any]
    load: list[LoadPoint]
    #: The served head (:func:`specserve.bench.runner.head_info`; None: none).
    head: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.header.to_json(),
            "prompt_set": self.prompt_set,
            "settings": self.settings,
            "head": self.head,
            "load": [asdict(p) for p in self.load],
        }


@dataclass
class FullRun:
    """``bench.json``: every figure of the report from one run (``specserve bench all``)."""

    header: Header
    kernels: str
    attention: str
    decode_steps: int
    heldout_prompts: bool
    settings: dict[str, Any]
    costs: Costs
    single_stream: SingleSummary
    greedy_identity: GreedyIdentity
    runs: list[Run]
    best_fixed_gamma: int
    load: list[LoadPoint]
    #: The served head (:func:`specserve.bench.runner.head_info`; None: none).
    head: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.header.command,
            "date_utc": self.header.date_utc,
            "machine": asdict(self.header.machine),
            "models": {"target": self.header.target, "draft": self.header.draft},
            "kernels": self.kernels,
            "attention": self.attention,
            "decode_steps": self.decode_steps,
            "heldout_prompts": self.heldout_prompts,
            "settings": self.settings,
            "costs": asdict(self.costs),
            "single_stream": _single_json(self.single_stream),
            "greedy_identity": self.greedy_identity.to_json(),
            "runs": _runs_json(self.runs),
            "best_fixed_gamma": self.best_fixed_gamma,
            "head": self.head,
            "load": [asdict(p) for p in self.load],
        }


# --------------------------------------------------------------------------- the stack under test


@dataclass(frozen=True)
class StackMetrics:
    """The ``/metrics`` URLs of the stack under test: the target's (load points read its passes and
    positions) and the coordinator's (the feature bytes it relays, :class:`FeatureBytes`)."""

    target: str
    coordinator: str


async def _process_stack(opts: StackOptions):
    """The stack under test, one process per role as in production and in ``specserve up`` (the roles
    share no GIL with each other or with the HF baselines, which run here while the stack waits), and
    its ``/metrics`` URLs (:class:`StackMetrics`)."""
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import free_port

    target_port, coordinator_port = free_port(), free_port()
    stack = await start_process_stack(
        target_model=opts.target,
        draft_model=opts.draft,
        redis_url=opts.redis_url,
        # "fastest" reaches here only from `load`, which loads no baselines: a target timing its kernels runs
        # without invariance.
        target_overrides={
            "metrics_port": target_port,
            "kernels": opts.kernels,
            "feature_head": head_overrides(opts)["feature_head"],  # the feature the draft's head reads
        },
        draft_overrides={"max_batch_size": opts.draft_batch, **head_overrides(opts)},
        coordinator_overrides={**_coordinator_overrides(opts.draft_batch), "metrics_port": coordinator_port},
    )
    metrics = StackMetrics(f"http://127.0.0.1:{target_port}/metrics", f"http://127.0.0.1:{coordinator_port}/metrics")
    return stack, metrics


def _served_modes(opts: StackOptions) -> list[str]:
    """Every single-stream mode the stack under test can serve (the head's only where the draft serves one)."""
    heads = head_info(opts) is not None
    return [m for m in SINGLE_MODES if heads or m not in HEAD_MODES]


def _coordinator_overrides(draft_batch: int) -> dict:
    """Settings of the benchmark's coordinator: no admission cap below what a load point sends."""
    return {
        "max_sessions": 4096,
        "max_sessions_per_client": 4096,
        "max_batch_size": 32,
        "draft_max_batch_size": draft_batch,
    }


async def _warm_up(client) -> None:
    """One short generation per mode family."""
    for mode in (GAMMA0, fixed(4), LOAD_ADAPTIVE, SpecMode("warm-up", 4, None)):  # the last: the server's proposer
        await _spec_generate(client, [1, 2, 3], 8, 0.0, 0, mode)


def _prompt_sets(opts: PromptOptions, tokenizer, *, copy: bool = False) -> dict[str, list[tuple[str, list[int]]]]:
    names = opts.prompt_sets or default_prompt_sets(tokenizer, copy=copy)
    return load_prompt_sets(names, tokenizer, opts.target, opts.prompts, opts.prompt_chars)


# --------------------------------------------------------------------------- the subcommands


async def measure_single(opts: SingleOptions) -> dict[str, Any]:
    """The single-stream table alone, for ``--modes`` (default: every mode the stack serves), each mode's
    median ms per token against gamma 0 through the same service and against HF assisted generation."""
    from specserve.client import AsyncClient

    torch.manual_seed(opts.seed)
    tokenizer, target, draft = load_pair(opts.target, opts.draft, kernels=opts.kernels)
    opts.kernels = cpu_kernels.path_of(target)
    prompts = _prompt_sets(opts, tokenizer)
    head = head_info(opts)
    if head is None:
        print(f"the feature head's modes are left out: the draft {opts.draft} serves no head (--head {opts.head})")
    only = [m for m in (opts.modes or _served_modes(opts)) if head is not None or m not in HEAD_MODES]
    stack, metrics = await _process_stack(opts)
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            await _warm_up(client)
            runs = await single_stream(
                client, target, draft, prompts, opts.temperatures, opts.max_new_tokens, opts.seed,
                repeats=opts.repeats, only=only, coordinator_metrics=metrics.coordinator,
            )  # fmt: skip
    finally:
        await stack.stop()
    return SingleRun(
        Header.of(opts), head is not None, opts.settings(), summarize_single(runs, head), GreedyIdentity.of(runs),
        runs, head,
    ).to_json()  # fmt: skip


async def measure_load(opts: LoadOptions) -> dict[str, Any]:
    """The load sweep alone (gamma 0, ``--fixed-gamma``, adaptive) on the first prompt set."""
    from transformers import AutoTokenizer

    from specserve.client import AsyncClient

    tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
    first = (opts.prompt_sets or default_prompt_sets(tokenizer))[0]
    named = load_prompt_sets([first], tokenizer, opts.target, opts.prompts, opts.prompt_chars)
    sweep = Sweep(opts.rates, opts.duration_s, opts.max_new_tokens, opts.repeats, opts.seed)
    head = head_info(opts)
    modes = load_modes(opts.fixed_gamma, opts.control, head_gamma_or_reason(opts, head))
    stack, metrics = await _process_stack(opts)
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            await _warm_up(client)
            load = await load_sweep(client, [ids for _, ids in named[first]], modes, sweep, metrics)
    finally:
        await stack.stop()
    return LoadRun(Header.of(opts), first, opts.settings(), load, head).to_json()


async def measure_all(opts: FullOptions) -> dict[str, Any]:
    """Single stream on every prompt set, the model costs, then the load sweep at the fixed gamma fastest
    on the first set (greedy)."""
    from specserve.client import AsyncClient

    torch.manual_seed(opts.seed)
    tokenizer, target, draft = load_pair(opts.target, opts.draft, kernels=opts.kernels)
    opts.kernels = cpu_kernels.path_of(target)  # "fastest" timed here: the service's target runs the path HF runs
    stock_target = load_pair(opts.target, opts.draft)[1] if opts.kernels == "onednn" else None
    prompts = _prompt_sets(opts, tokenizer, copy=True)
    heldout_ok = all(n in ("chat", "chat-code", "copy") for n in prompts) or heldout_files(Path(opts.target))[1]
    costs = measure_costs(target, draft, repeats=opts.cost_repeats, draft_threads=COLOCATED_DRAFT_THREADS)
    sweep = Sweep(opts.rates, opts.load_duration_s, opts.load_max_new_tokens, opts.load_repeats, opts.seed)
    head = head_info(opts)
    head_gamma = head_gamma_or_reason(opts, head)

    stack, metrics = await _process_stack(opts)
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            await _warm_up(client)
            runs = await single_stream(
                client, target, draft, prompts, opts.temperatures, opts.max_new_tokens, opts.seed,
                stock_target=stock_target, repeats=opts.single_repeats, only=_served_modes(opts),
                coordinator_metrics=metrics.coordinator,
            )  # fmt: skip
            summary = summarize_single(runs, head)
            greedy_first = summary.get(f"{next(iter(prompts))} T=0", {})  # the load sweep's fixed gamma
            best_fixed = min(
                FIXED_GAMMAS,
                key=lambda g: s.ms_per_token_median if (s := greedy_first.get(fixed(g).name)) else float("inf"),
            )
            load_prompts = [ids for _, ids in next(iter(prompts.values()))]
            modes = load_modes(best_fixed, opts.load_control, head_gamma)
            load = await load_sweep(client, load_prompts, modes, sweep, metrics)
    finally:
        await stack.stop()
    return FullRun(
        header=Header.of(opts),
        kernels=opts.kernels,
        attention=target.config._attn_implementation,  # the workers' (specserve.engine.attention), here and there
        decode_steps=CoordinatorSettings.model_fields["decode_steps"].default,
        heldout_prompts=heldout_ok,
        settings=opts.settings(),
        costs=costs,
        single_stream=summary,
        greedy_identity=GreedyIdentity.of(runs),
        runs=runs,
        best_fixed_gamma=best_fixed,
        load=load,
        head=head,
    ).to_json()


def bench_all(opts: FullOptions) -> int:
    """``specserve bench all``: ``bench.json`` and the whole report, ``README.md`` (an earlier ``load`` run's
    files go: this run's sweep supersedes them)."""

    def write(data: dict[str, Any], out: Path) -> Path:
        for older in ("load.json", "load.md"):
            (out / older).unlink(missing_ok=True)
        return report.write_report(data, out)

    return run_mode(opts, measure_all, "bench", write)


# A subcommand of its own writes <name>.json and its section alone as <name>.md; README.md is left alone (it may
# carry analysis added by hand): the next `all` run or `specserve bench report` renders the section into it.


def bench_single(opts: SingleOptions) -> int:
    """``specserve bench single``: ``single.json`` and ``single.md``."""
    return run_mode(opts, measure_single, "single", report.write_single)


def bench_load(opts: LoadOptions) -> int:
    """``specserve bench load``: ``load.json`` and ``load.md``."""
    return run_mode(opts, measure_load, opts.name, lambda data, out: report.write_load(data, out, opts.name))


def bench_latency(opts: LatencyOptions) -> int:
    """``specserve bench latency``: ``<name>.json`` and ``<name>.md`` (specserve/bench/latency.py)."""
    from specserve.bench.latency import measure_for

    return run_mode(opts, measure_for, opts.name, lambda data, out: report.write_latency(data, out, opts.name))
