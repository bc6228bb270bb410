"""A 6-turn chat of default requests through the official ``openai`` client, prefix cache on and off
(issue 53, the prefix cache's must-show).

One-off check, not shipped. It starts two stacks as ``specserve up`` starts them (one process per role,
the default pair, the OpenAI HTTP API on), one with the prefix cache off on both workers, and runs
greedy chats turn by turn on both, interleaved (the stack that goes first alternates): every turn sends
the whole conversation so far with a new user message of about 70 tokens, asks for ``--answer-tokens``
tokens (EOS ignored), streams the reply and reads ``usage.prompt_tokens_details.cached_tokens``. The
requests set nothing else: they draft with the server's default proposer. After the last turn, a fresh
chat whose prompt is as long as the last turn's new tokens runs on the cache-on stack. Per turn it
records the time to the first streamed token as the client sees it, the prompt and cached tokens, and
whether both stacks answered the same.

    python -m benchmarks prefix-cache-openai --json docs/benchmarks/prefix_cache_openai.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

from openai import OpenAI

from specserve.prompts.chat import heldout_prompts


def stream_chat(client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    text = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and first is not None
    details = usage.prompt_tokens_details
    return {
        "ttft_ms": 1e3 * first,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
        "completion_tokens": usage.completion_tokens,
        "text": "".join(text),
    }


def user_messages(turns: int, seed: int) -> list[str]:
    import random

    pool = [p.messages[0]["content"] for p in heldout_prompts("chat")]
    rng = random.Random(seed)
    return [" ".join(rng.sample(pool, 4)) for _ in range(turns)]


async def chat_turns(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import private_redis

    runs: list[dict[str, Any]] = []
    fresh: list[dict[str, Any]] = []
    with private_redis(None) as redis_url:
        async with contextlib.AsyncExitStack() as up:
            clients = {}
            for mode, on in (("on", True), ("off", False)):
                stack = await start_process_stack(
                    target_model=None, draft_model=None, redis_url=redis_url, http_port=0,
                    target_overrides={"prefix_cache": on}, draft_overrides={"prefix_cache": on},
                )
                up.push_async_callback(stack.stop)
                client = OpenAI(base_url=stack.http_url, api_key="none", timeout=900)
                model = client.models.list().data[0].id
                stream_chat(client, model, [{"role": "user", "content": "Hi"}], 4)  # warm up
                clients[mode] = (client, model)
            for conversation in range(args.conversations):
                users = user_messages(args.turns, conversation)
                messages: dict[str, list[dict[str, str]]] = {"on": [], "off": []}
                for turn in range(args.turns):
                    order = ("on", "off") if (conversation + turn) % 2 == 0 else ("off", "on")
                    replies = {}
                    for mode in order:
                        client, model = clients[mode]
                        messages[mode].append({"role": "user", "content": users[turn]})
                        reply = await asyncio.to_thread(stream_chat, client, model, messages[mode], args.answer_tokens)
                        messages[mode].append({"role": "assistant", "content": reply["text"]})
                        replies[mode] = reply
                    for mode in ("on", "off"):
                        r = {k: v for k, v in replies[mode].items() if k != "text"}
                        runs.append({"conversation": conversation, "turn": turn + 1, "mode": mode,
                                     "same_answer": replies["on"]["text"] == replies["off"]["text"], **r})
                        print(json.dumps(runs[-1]), flush=True)
                last_on = [r for r in runs if r["conversation"] == conversation and r["mode"] == "on"][-1]
                new_tokens = last_on["prompt_tokens"] - last_on["cached_tokens"]
                # A fresh chat of as many prompt tokens as the last turn's new ones: its last answer and new question.
                client, model = clients["on"]
                text = messages["on"][-2]["content"] + " " + messages["on"][-3]["content"]
                words = text.split()
                for _ in range(8):  # trim to about the same prompt length
                    probe = stream_chat(client, model, [{"role": "user", "content": " ".join(words)}], 1)
                    if abs(probe["prompt_tokens"] - new_tokens) <= 8 or len(words) < 10:
                        break
                    words = words[: max(5, int(len(words) * new_tokens / probe["prompt_tokens"]))]
                salt = f"fresh-{conversation}-{time.time()}"  # no cached prefix: a cold prompt
                cold = [{"role": "system", "content": salt}, {"role": "user", "content": " ".join(words)}]
                fresh.append({"conversation": conversation, "target_new_tokens": new_tokens,
                              **{k: v for k, v in stream_chat(client, model, cold, args.answer_tokens).items() if k != "text"}})
                print(json.dumps(fresh[-1]), flush=True)

    turns = args.turns
    last = [r for r in runs if r["turn"] == turns and r["mode"] == "on"]
    earlier = [r for r in runs if r["turn"] == turns - 1 and r["mode"] == "on"]
    share = [lt["cached_tokens"] / (e["prompt_tokens"] + e["completion_tokens"]) for lt, e in zip(last, earlier, strict=True)]
    ratio = [lt["ttft_ms"] / f["ttft_ms"] for lt, f in zip(last, fresh, strict=True)]
    summary = {
        "cached_share_of_earlier_turns_at_last_turn": share,
        "last_turn_ttft_over_fresh": ratio,
        "answers_identical_on_and_off": all(r["same_answer"] for r in runs),
        "median_ttft_ms_by_turn_on": {t: statistics.median(r["ttft_ms"] for r in runs if r["turn"] == t and r["mode"] == "on")
                                      for t in range(1, turns + 1)},
        "median_ttft_ms_by_turn_off": {t: statistics.median(r["ttft_ms"] for r in runs if r["turn"] == t and r["mode"] == "off")
                                       for t in range(1, turns + 1)},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "fresh": fresh, "summary": summary, "args": vars(args)}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(chat_turns(argv))


if __name__ == "__main__":
    main()
