"""What the service adds to each round: gamma = 0 through the whole system against HF ``generate()``.

Run (one run, one machine; the figures in docs/benchmarks come from it)::

    python -m benchmarks overhead --json docs/benchmarks/overhead.json

The same held-out chat prompts go, greedy (or all sampled at ``--temperature``)
and with ``ignore_eos`` (so every run commits exactly ``--max-new-tokens``
tokens), through:

* **HF target-only**: ``model.generate()`` in this process (float32,
  ``--threads`` threads);
* **specserve gamma = 0**: a stack of one process per role (``specserve serve
  target`` and ``coordinator``; no draft), the target with the same dtype and
  thread count, through the SDK; one stack per ``--decode-steps`` value (target
  steps per Verify call after the first token: 1 is one round trip, one
  commit and one coordinator round per token; the coordinator's default
  amortizes them over several steps), all up at once.

HF and every stack take turns prompt by prompt, in a rotating order, so drift on
a shared machine hits all of them alike.
Every specserve round is split, from the statistics the system reports, into:

``forward``
    the target's forward pass (``GenerationStats.forward_ns``);
``target``
    the rest of the target's own account of the Verify call: loading the
    session, processing the logits, the acceptance rule, the commit to Redis,
    the thread hops (``target_ns - forward_ns``);
``network``
    the Verify call as the coordinator saw it minus the target's account:
    gRPC both ways, serialisation, the batcher (``verify_ns - target_ns``);
``coordinator``
    the rest of the request's wall time: the round loop, the policy,
    detokenizing, streaming to the client (``total_ns - verify_ns - draft_ns``).

The *fixed overhead per round* is everything but ``forward``; per committed
token it is that divided by the tokens a round commits.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.options import OverheadOptions
from specserve.bench import markdown as md
from specserve.bench.pair import hf_generate
from specserve.bench.timing import timed_generate


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from specserve.prompts.chat import heldout_prompts

    out = []
    for p in heldout_prompts("chat", n):
        text = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


async def measure(args: OverheadOptions) -> dict:
    from specserve.engine import cpu_kernels
    from specserve.engine.models import load_model, resolve_model_path
    from specserve.launch.redis_server import private_redis

    torch.set_num_threads(args.threads)
    target = resolve_model_path(args.target, "target")
    loaded = load_model(target, device="cpu", dtype="float32", kernels=args.kernels)
    tokenizer, model = loaded.tokenizer, loaded.model
    kernels = cpu_kernels.path_of(model)
    prompts = _prompts(tokenizer, args.prompts)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the target process: the same thread count
    hf: list[float] = []
    with private_redis(args.redis_url) as redis_url:
        runs = await _interleaved_runs(args, target, kernels, redis_url, model, prompts, hf)
    return summarize(hf, runs, args, kernels)


async def _interleaved_runs(args, target, kernels, redis_url, model, prompts, hf) -> dict[int, list[dict]]:
    """Every prompt through one stack per ``--decode-steps`` value (all up at once, the idle ones waiting),
    interleaved prompt by prompt with HF target-only runs (appended to ``hf``) in a rotating order, so that
    the machine's drift hits every setting alike."""
    from specserve.client import AsyncClient
    from specserve.launch.local import start_process_stack

    kw = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "ignore_eos": True, "gamma": 0}
    stacks, clients = {}, {}
    runs: dict[int, list[dict]] = {steps: [] for steps in args.decode_steps}
    try:
        for steps in args.decode_steps:
            stacks[steps] = await start_process_stack(
                target_model=target, draft_model=None, redis_url=redis_url, with_draft=False,
                target_overrides={"dtype": "float32", "kernels": kernels},
                coordinator_overrides={"decode_steps": steps},
            )  # fmt: skip
            clients[steps] = AsyncClient(stacks[steps].address, timeout=600)
            await clients[steps].generate(
                prompt_token_ids=prompts[0], **{**kw, "max_new_tokens": 4}
            )  # warm-up
        hf_generate(model, prompts[0], 4, args.temperature)
        order: list[int | None] = [None, *args.decode_steps]  # None: HF
        for i, ids in enumerate(prompts * args.repeats):
            for which in order[i % len(order) :] + order[: i % len(order)]:
                if which is None:
                    hf.append(hf_generate(model, ids, args.max_new_tokens, args.temperature)[1] / args.max_new_tokens)
                    continue
                result, wall = await timed_generate(clients[which], prompt_token_ids=ids, **kw)
                s = result.stats
                assert s.completion_tokens == args.max_new_tokens
                runs[which].append(
                    {
                        "client_s_per_token": wall / s.completion_tokens,
                        "tokens": s.completion_tokens,
                        "rounds": s.rounds,
                        "total_ns": s.total_ns,
                        "verify_ns": s.verify_ns,
                        "target_ns": s.target_ns,
                        "forward_ns": s.forward_ns,
                        "draft_ns": s.draft_ns,
                    }
                )
    finally:
        for client in clients.values():
            await client.close()
        for stack in stacks.values():
            await stack.stop()
    return runs


def _breakdown(runs: list[dict]) -> dict:
    """Per round (and per committed token) figures of one setting's runs."""
    rounds = sum(r["rounds"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)

    def per_round(key_a: str, key_b: str | None = None) -> float:
        total = sum(r[key_a] - (r[key_b] if key_b else 0) for r in runs)
        return total / rounds / 1e6

    breakdown = {
        "forward_ms": per_round("forward_ns"),
        "target_ms": per_round("target_ns", "forward_ns"),
        "network_ms": per_round("verify_ns", "target_ns"),
        "coordinator_ms": sum(r["total_ns"] - r["verify_ns"] - r["draft_ns"] for r in runs) / rounds / 1e6,
    }
    breakdown["fixed_overhead_ms"] = (
        breakdown["target_ms"] + breakdown["network_ms"] + breakdown["coordinator_ms"]
    )
    breakdown["tokens_per_round"] = tokens / rounds
    breakdown["fixed_overhead_ms_per_token"] = breakdown["fixed_overhead_ms"] * rounds / tokens
    return breakdown


def summarize(
    hf: list[float], runs: dict[int, list[dict]], args: OverheadOptions, kernels: str = "stock"
) -> dict:
    from specserve.runtime.config import CoordinatorSettings

    ms = 1e3
    hf_ms = statistics.median(hf) * ms
    default = CoordinatorSettings.model_fields["decode_steps"].default
    settings = {}
    for steps, these in runs.items():
        spec_ms = statistics.median(r["client_s_per_token"] for r in these) * ms
        settings[str(steps)] = {
            "specserve_gamma0_ms_per_token": spec_ms,
            "specserve_vs_hf": hf_ms / spec_ms,
            "per_round": _breakdown(these),
            "specserve_ms_per_token_all": [r["client_s_per_token"] * ms for r in these],
        }
    return {
        "command": args.command,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads},
        "kernels": kernels,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "hf_ms_per_token": hf_ms,
        "default_decode_steps": default,
        "decode_steps": settings,
        "hf_ms_per_token_all": [x * ms for x in hf],
    }


def _sampling(data: dict) -> str:
    temperature = data.get("temperature", 0.0)
    return "greedy" if temperature == 0 else f"sampled at T={temperature:g}"


def section(data: dict) -> list[str]:
    """The report's section: ``overhead.md`` (:func:`write`)."""
    settings = data["decode_steps"]
    default = str(data["default_decode_steps"])
    shown = sorted(settings, key=int)
    ratio = settings[default]["specserve_vs_hf"] if default in settings else None
    verdict = "not measured" if ratio is None else ("met" if ratio >= 0.95 else "missed")

    def row(label: str, value) -> list[str]:
        return [label, *(value(settings[k]) for k in shown)]

    lines = [
        f"## The service's own overhead (gamma = 0, {_sampling(data)}, {data['max_new_tokens']} tokens, "
        f"{data['prompts']} held-out chat prompts, one process per role)",
        "",
        f"Command: `{data['command']}` ({data['when']}). HF `generate()` of the target alone: "
        f"{data['hf_ms_per_token']:.2f} ms/token. specserve at gamma = 0 with the same model, dtype, threads "
        f"and linear kernels ({data.get('kernels', 'stock')}), one stack per `decode_steps` value (target steps "
        "per Verify call after the first token), all up at once and taking turns with HF prompt by prompt; the "
        "coordinator's default is "
        f"{default}. At the default, **{ratio:.2f}x** of HF (target: 0.95x or better: **{verdict}**)."
        if ratio is not None
        else f"Command: `{data['command']}` ({data['when']}): the default decode_steps ({default}) was not run.",
        "",
    ]
    rows = [
        row("ms per token (median over prompts)", lambda d: f"{d['specserve_gamma0_ms_per_token']:.2f}"),
        row("vs HF target-only", lambda d: f"{d['specserve_vs_hf']:.2f}x"),
        row("tokens per round", lambda d: f"{d['per_round']['tokens_per_round']:.2f}"),
        row("target forward passes, ms per round", lambda d: f"{d['per_round']['forward_ms']:.2f}"),
        row(
            "rest of the target's Verify (session, logits, decision, commit, thread hops), ms per round",
            lambda d: f"{d['per_round']['target_ms']:.2f}",
        ),
        row(
            "network (gRPC both ways, serialisation, batcher), ms per round",
            lambda d: f"{d['per_round']['network_ms']:.2f}",
        ),
        row(
            "coordinator (round loop, policy, detokenizing, streaming), ms per round",
            lambda d: f"{d['per_round']['coordinator_ms']:.2f}",
        ),
        row(
            "**fixed overhead per round** (all but the forward passes), ms",
            lambda d: f"**{d['per_round']['fixed_overhead_ms']:.2f}**",
        ),
        row(
            "fixed overhead per committed token, ms",
            lambda d: f"{d['per_round']['fixed_overhead_ms_per_token']:.2f}",
        ),
    ]
    return [*lines, *md.table(["", *(f"decode_steps = {k}" for k in shown)], rows), ""]


def write(data: dict, out: Path) -> Path:
    """``overhead.json``'s section alone, as ``<out>/overhead.md``."""
    return md.write(out, "overhead", section(data))


def main(opts: OverheadOptions) -> int:
    """``python -m benchmarks overhead``: prints the section, and writes the figures to ``--json`` and the
    section beside them as ``overhead.md``."""
    result = asyncio.run(measure(opts))
    print("\n".join(section(result)))
    if opts.json is not None:
        md.write_json(opts.json, result)
        write(result, opts.json.parent)
    return 0
