"""Time to first token of a prompt another API key sent first, against a cold prompt and a cache hit (issue 54).

The default pair on CPU (target, draft and coordinator in this process, a private ``redis-server``), the
coordinator with two API keys and the prefix cache scoped by tenant (the default). For each of ``--prompts``
fresh prompts (about ``--tokens`` tokens of held-out chat text, the target's chat template): key A sends it
(cold), key B sends the same prompt (another tenant: it must be cold too), key A sends it again (a hit);
each a greedy generation of ``--new`` tokens at gamma 0 with the model proposer (a feature-head session
attaches nothing: docs/design.md, "The prefix cache"). Reported per case: ``GenerationStats.first_token_ns``
(median, quartiles) and ``cached_tokens``.

    python -m benchmarks prefix-cache-tenancy --prompts 12 --out docs/benchmarks

Writes ``<out>/prefix_cache_tenancy.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import uuid
from pathlib import Path

CASES = ("cold", "other_key", "same_key")


async def run(args: argparse.Namespace) -> dict:
    import grpc
    from pydantic import SecretStr

    from benchmarks.prefix_cache import _render, _user_messages
    from specserve.launch.local import start_local_stack
    from specserve.launch.redis_server import RedisServer
    from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    keys = {"a": f"key-a-{uuid.uuid4().hex}", "b": f"key-b-{uuid.uuid4().hex}"}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp)).start()
        try:
            stack = await start_local_stack(
                target_model=None,
                draft_model=None,
                redis_url=redis.url,
                device="cpu",
                dtype="float32",
                coordinator_overrides={"auth_tokens": [SecretStr(k) for k in keys.values()]},
                target_overrides={"warmup": False},
                draft_overrides={"warmup": False},
            )
            tokenizer = stack.coordinator.coordinator.tokenizer
            try:
                async with grpc.aio.insecure_channel(stack.address) as channel:
                    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)

                    async def generate(key: str, ids: list[int]) -> tuple[int, int, list[int]]:
                        req = coordinator_pb2.GenerateRequest(
                            tokens=coordinator_pb2.PromptTokens(token_ids=ids),
                            sampling=common_pb2.SamplingParams(temperature=0.0),
                            stop=common_pb2.StopConditions(max_new_tokens=args.new, ignore_eos=True),
                            speculation=coordinator_pb2.SpeculationParams(gamma=0, proposer=common_pb2.PROPOSER_KIND_MODEL),
                        )
                        tokens: list[int] = []
                        stats = None
                        async for reply in stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),)):
                            if reply.WhichOneof("event") == "chunk":
                                tokens.extend(reply.chunk.token_ids)
                            else:
                                stats = reply.stats
                        assert stats is not None
                        return stats.first_token_ns, stats.cached_tokens, tokens

                    await generate(keys["a"], _render(tokenizer, [{"role": "user", "content": "warm up"}]))
                    for i in range(args.prompts):
                        text = _user_messages(tokenizer, 1, 20_000 + i, args.tokens)[0]
                        ids = _render(tokenizer, [{"role": "user", "content": text}])
                        outputs = []
                        for case, key in zip(CASES, (keys["a"], keys["b"], keys["a"]), strict=True):
                            ttft_ns, cached, tokens = await generate(key, ids)
                            outputs.append(tokens)
                            row = {"prompt": i, "case": case, "prompt_tokens": len(ids), "cached_tokens": cached,
                                   "ttft_ms": ttft_ns / 1e6}
                            runs.append(row)
                            print(json.dumps(row), flush=True)
                        assert outputs[0] == outputs[1] == outputs[2], "greedy output differs"
            finally:
                await stack.stop(grace=0.5)
        finally:
            redis.stop()

    def quartiles(case: str) -> dict:
        values = sorted(r["ttft_ms"] for r in runs if r["case"] == case)
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        return {"median_ms": q[1], "q1_ms": q[0], "q3_ms": q[2],
                "cached_tokens": sorted({r["cached_tokens"] for r in runs if r["case"] == case})}

    return {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
            "summary": {case: quartiles(case) for case in CASES}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=200, help="user-message tokens per prompt")
    parser.add_argument("--new", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache_tenancy.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1), flush=True)
    return 0

