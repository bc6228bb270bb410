"""Greedy output through the whole system against stock Hugging Face ``generate()``, prompt by prompt.

Run (docs/benchmarks/invariance.md, "Greedy identity, the default pair", comes from it)::

    python -m benchmarks greedy-identity --n 200 --max-new-tokens 32 --out DIR

The held-out chat and code prompts of :mod:`specserve.prompts.chat` (code first, then chat, ``--n``
in all), each rendered with the target's chat template into token ids. The reference is the target loaded
by plain transformers in float32 (stock kernels and attention: code this project did not write),
``generate(do_sample=False)``, EOS ignored, batch 1. The system is one ``specserve serve`` process per role
(:func:`specserve.launch.local.start_process_stack`: coordinator, target on its defaults, the model draft),
float32 on CPU, and every prompt is sent as token ids, greedy, EOS ignored, in each configuration:

* ``alone``: one request at a time, the automatic speculation policy;
* ``batched``: ``--concurrency`` requests at a time (each beside seven others), the automatic policy;
* ``gamma0``, ``gamma1``, ``gamma4``: ``--concurrency`` at a time at that fixed gamma.

The prompts go in chunks of eight (the references, then every configuration on them), so a run stopped early
still has complete results for the prompts it did, and the same command run again continues after them
(:func:`resumed`). A reply that differs is recorded with its first differing
position and, at that position, the gap between the reference's two largest logits (a near-tie shows as a
tiny gap). ``OUT/greedy_identity.json`` and ``OUT/greedy_identity.md`` (the report) are rewritten after each
chunk.
"""

from __future__ import annotations

import asyncio
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.options import GREEDY_CONFIGS, GreedyIdentityOptions
from specserve.bench import markdown as md
from specserve.bench.timing import Stopwatch

CHUNK = 8  # prompts per step: one batch of eight

CONFIGS = GREEDY_CONFIGS  # name -> (requests at a time, gamma; None: the automatic policy)


def prompts(tokenizer: Any, n: int) -> list[tuple[str, list[int]]]:
    """``n`` held-out prompts (code, then chat) as (name, token ids of the rendered conversation)."""
    from specserve.prompts.chat import heldout_prompts

    chosen = [*heldout_prompts("code"), *heldout_prompts("chat")][:n]
    if len(chosen) < n:
        raise SystemExit(f"only {len(chosen)} held-out prompts exist; ask for at most that many")
    out = []
    for p in chosen:
        text = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        out.append((p.name, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def references(model: Any, items: list[tuple[str, list[int]]], max_new: int) -> list[list[int]]:
    """Stock ``generate()`` of each prompt: greedy, float32, EOS ignored, batch 1."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    # EOS ignored, as the system is asked to: generate() fills an unset eos_token_id from the model's own
    # generation config, so the model's is cleared (before this, replies that ended at EOS were cut short).
    model.generation_config.eos_token_id = None
    out = []
    for _, ids in tqdm(items, desc="reference generate()", file=sys.stderr):
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
        out.append(y[0, len(ids) :].tolist())
        if len(out[-1]) != max_new:
            raise RuntimeError(f"generate() stopped after {len(out[-1])} of {max_new} tokens")
    return out


def top2_gap(model: Any, ids: list[int]) -> float:
    """The reference's largest logit minus its second largest, for the position after ``ids``."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


async def run_config(
    address: str, items, max_new: int, concurrency: int, gamma: int | None, proposer: str = "model"
) -> list[list[int]]:
    import grpc

    from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    limit = asyncio.Semaphore(concurrency)

    async def one(stub, ids: list[int]) -> list[int]:
        request = coordinator_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(temperature=0.0),
            stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True),
            speculation=coordinator_pb2.SpeculationParams(
                proposer=common_pb2.PROPOSER_KIND_FEATURE if proposer == "feature" else common_pb2.PROPOSER_KIND_MODEL
            ),
        )
        if gamma is not None:
            request.speculation.gamma = gamma
        request.tokens.token_ids.extend(ids)
        tokens: list[int] = []
        async with limit:
            async for reply in stub.Generate(request, timeout=1800):
                if reply.WhichOneof("event") == "chunk":
                    tokens.extend(reply.chunk.token_ids)
        return tokens

    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return list(await asyncio.gather(*(one(stub, ids) for _, ids in items)))


#: What must match for an earlier run's results to be continued rather than started over.
_RUN_KEYS = ("target", "draft", "n", "max_new_tokens")


def resumed(path: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """An earlier run's results at ``path`` to continue from, or ``fresh``.

    They are continued only when they are of the same run (models, prompt count, reply length and
    configurations) and were written after a whole chunk; anything else starts over, saying why.
    """
    import json

    if not path.exists():
        return fresh
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"starting over: {path} is not readable ({exc})", file=sys.stderr)
        return fresh
    same = all(old.get(k) == fresh[k] for k in _RUN_KEYS) and set(old.get("configs", {})) == set(fresh["configs"])
    if not same or (old.get("done", 0) % CHUNK and old.get("done") != fresh["n"]):
        print(f"starting over: {path} holds a different run", file=sys.stderr)
        return fresh
    old["command"] = fresh["command"]
    return old


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def measure(args: GreedyIdentityOptions) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.engine.models import resolve_model_path
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import private_redis

    target = resolve_model_path(args.target, "target")
    draft = resolve_model_path(args.draft, "draft")
    tokenizer = AutoTokenizer.from_pretrained(target)
    items = prompts(tokenizer, args.n)
    if args.only:
        unknown = sorted(set(args.only) - {name for name, _ in items})
        if unknown:
            raise SystemExit(f"no such prompt among the first {args.n}: {', '.join(unknown)}")
        items = [item for item in items if item[0] in args.only]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    data: dict[str, Any] = {
        "command": args.command,
        "when_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.platform()}, torch {torch.__version__}",
        "target": target,
        "draft": draft,
        "n": len(items),
        "done": 0,
        "max_new_tokens": args.max_new_tokens,
        "reference_s": 0.0,
        "configs": {
            name: {
                "concurrency": CONFIGS[name][0],
                "gamma": "auto" if CONFIGS[name][1] is None else CONFIGS[name][1],
                "identical": 0,
                "tokens": 0,
                "seconds": 0.0,
                "differ": [],
            }
            for name in args.configs
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = resumed(out / "greedy_identity.json", data)
    if data["done"]:
        print(f"resuming after {data['done']} prompts done ({out / 'greedy_identity.json'})", file=sys.stderr)
    with private_redis(None) as redis_url:
        stack = await start_process_stack(
            target_model=target,
            draft_model=draft,
            redis_url=redis_url,
            device="cpu",
            dtype="float32",
            coordinator_overrides={
                "max_sessions_per_client": 1000,
                "session_rate_per_client": 1e9,
                "rpc_timeout_s": 600.0,  # a busy machine: a slow pass is not a failed replica
            },
            target_overrides={"warmup": False},  # warm-up only times; the kernel path is a setting
            draft_overrides={"warmup": False},
            start_timeout_s=1800.0,  # a busy machine
        )
        try:
            # In chunks of CHUNK prompts: the references, then every configuration; the JSON after each chunk
            # holds complete results for the prompts done so far.
            for first in range(data["done"], len(items), CHUNK):
                chunk = items[first : first + CHUNK]
                with Stopwatch() as ref_sw:
                    refs = references(model, chunk, args.max_new_tokens)
                data["reference_s"] = round(data["reference_s"] + ref_sw.seconds, 1)
                for name, c in data["configs"].items():
                    concurrency, gamma = CONFIGS[name]
                    with Stopwatch() as config_sw:
                        got = await run_config(stack.address, chunk, args.max_new_tokens, concurrency, gamma, args.proposer)
                    for (prompt_name, ids), want, have in zip(chunk, refs, got, strict=True):
                        if have == want:
                            c["identical"] += 1
                            continue
                        at = _first_difference(have, want)
                        gap = top2_gap(model, ids + want[:at]) if at < len(want) else None
                        c["differ"].append({"prompt": prompt_name, "position": at, "reference_top2_gap": gap})
                    c["tokens"] += sum(len(g) for g in got)
                    c["seconds"] = round(c["seconds"] + config_sw.seconds, 1)
                data["done"] += len(chunk)
                md.write(out, "greedy_identity", render(data), data)
                summary = {name: c["identical"] for name, c in data["configs"].items()}
                print(f"{data['done']} prompts: identical {summary}", file=sys.stderr, flush=True)
        finally:
            await stack.stop(grace=2.0)
    md.write(out, "greedy_identity", render(data))
    return data


def render(data: dict) -> str:
    lines = [
        "## Greedy identity, the default pair",
        "",
        f"Measured {data['when_utc']} ({data['machine']}); one run of:",
        "",
        *md.command_block(data["command"]),
        f"{data['done']} held-out chat and code prompts (`specserve/prompts/chat.py`), "
        f"{data['max_new_tokens']} tokens each (EOS ignored), through the system (one `specserve serve` process "
        "per role, float32 on CPU, the target on its defaults; requests drafted by the token draft, or by the "
        "feature head where the command says `--proposer feature`) against stock transformers "
        "`generate(do_sample=False)` of the target in float32, batch 1:",
        "",
        *(
            [f"(The run was stopped after {data['done']} of the {data['n']} prompts it was asked for.)", ""]
            if data["done"] < data["n"]
            else []
        ),
        *md.table(
            ("configuration", "requests at a time", "gamma", "token-identical", "seconds"),
            ((name, c["concurrency"], c["gamma"], f"**{c['identical']} of {data['done']}**", c["seconds"])
             for name, c in data["configs"].items()),
        ),
    ]  # fmt: skip
    differ = [(name, d) for name, c in data["configs"].items() for d in c["differ"]]
    if differ:
        lines += [
            "",
            "Replies that differ (the reference's gap between its two largest logits where they part):",
            "",
        ]
        lines += md.table(
            ("configuration", "prompt", "first differing token", "top-2 logit gap"),
            ((name, f"`{d['prompt']}`", d["position"],
              "-" if d["reference_top2_gap"] is None else f"{d['reference_top2_gap']:.2e}")
             for name, d in differ),
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(opts: GreedyIdentityOptions) -> int:
    """``python -m benchmarks greedy-identity``: ``<out>/greedy_identity.json`` and ``.md``, the report printed."""
    data = asyncio.run(measure(opts))
    print(render(data))
    return 0
