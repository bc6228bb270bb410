"""The target's prefill work per turn of a chat, prefix cache on and off, in CPU time (issue 42).

A stand-in for the end-to-end time to first token (``python -m benchmarks prefix-cache``) on a machine too busy
for wall-clock figures: the default target, loaded and prepared as a target replica loads it (invariant
passes, ``kernels=auto``), and two KV-cache stores as the target's (``SessionCacheStore``), the prefix cache
on in one and off in the other. Each turn of a 6-turn chat (the target's chat template; about 160-token
user messages and 64-token answers, the answers held-out text rather than generated, since only lengths
matter here) is a new session brought to its pending token exactly as the target's first Verify does
(``attach``, ``reconcile(pending=True)``, ``share``, then released as at the end of a generation), on each
store in turn (the order alternating); then a fresh chat as long as the last turn's new tokens. Measured:
the model thread's CPU time (``time.thread_time``, torch on one thread, so that it is all the work) and
wall time of that work, and the tokens fed.

    python -m benchmarks prefix-cache-prefill --repeats 2 --out docs/benchmarks

Writes ``<out>/prefix_cache_prefill.json`` (``prefix_cache_prefill_stock.json`` with ``--no-invariant``); docs/benchmarks/prefix-cache.md reads it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-tokens", type=int, default=160)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--no-invariant", action="store_true", help="the target's passes as with --no-invariant")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.prefix_cache import _render, _user_messages
    from specserve.engine import position_invariant
    from specserve.engine.kvcache import SessionCacheStore
    from specserve.engine.models import load_model, resolve_model_path

    torch.set_num_threads(1)  # the thread's CPU time is then all the work (no intra-op helpers)
    loaded = load_model(resolve_model_path(None, "target"), device="cpu", dtype="float32", kernels="auto")
    if not args.no_invariant:
        position_invariant.prepare(loaded.model)
    tokenizer = loaded.tokenizer
    stores = {
        mode: SessionCacheStore(loaded.model, max_sessions=64, budget_bytes=4 * 1024**3, ttl_s=3600, prefix_cache=on)
        for mode, on in (("on", True), ("off", False))
    }
    runs = []
    count = 0

    def prefill(mode: str, ids: list[int]) -> dict:
        nonlocal count
        count += 1
        store = stores[mode]
        sid = f"{mode}-{count}"
        cpu, wall = time.thread_time(), time.perf_counter()
        with torch.inference_mode():
            cache, _ = store.get_or_create(sid)
            cached = store.attach(cache, ids, most=len(ids) - 1)
            fed = cache.reconcile(ids, pending=True).fed
            store.share(cache)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        store.release(sid)
        return {"mode": mode, "prompt_tokens": len(ids), "cached_tokens": cached, "fed": fed,
                "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3}

    for repeat in range(args.repeats):
        users = _user_messages(tokenizer, args.turns, repeat, args.user_tokens)
        answers = _user_messages(tokenizer, args.turns, 500 + repeat, args.answer_tokens)
        messages: list[dict[str, str]] = []
        previous = 0
        for turn in range(args.turns):
            messages.append({"role": "user", "content": users[turn]})
            ids = _render(tokenizer, messages)
            for mode in ("on", "off") if (repeat + turn) % 2 == 0 else ("off", "on"):
                run = {"repeat": repeat, "turn": turn + 1, "new_tokens": len(ids) - previous, **prefill(mode, ids)}
                runs.append(run)
                print(json.dumps(run), flush=True)
            previous = len(ids)
            messages.append({"role": "assistant", "content": answers[turn]})
        new = runs[-1]["new_tokens"]
        other = _user_messages(tokenizer, 1, 10_000 + repeat, new)[0]
        ids = _render(tokenizer, [{"role": "user", "content": other}])[:new]
        for mode in ("on", "off"):
            run = {"repeat": repeat, "turn": "fresh", "new_tokens": len(ids), **prefill(mode, ids)}
            runs.append(run)
            print(json.dumps(run), flush=True)

    def med(turn, mode, key="cpu_ms"):
        return statistics.median(r[key] for r in runs if r["turn"] == turn and r["mode"] == mode)

    last = args.turns
    summary = {
        "last_on_over_fresh_cpu": med(last, "on") / med("fresh", "on"),
        "last_off_over_on_cpu": med(last, "off") / med(last, "on"),
        "last_on_over_fresh_wall": med(last, "on", "wall_ms") / med("fresh", "on", "wall_ms"),
        "last_off_over_on_wall": med(last, "off", "wall_ms") / med(last, "on", "wall_ms"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "summary": summary}
    (args.out / ("prefix_cache_prefill_stock.json" if args.no_invariant else "prefix_cache_prefill.json")).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0

