"""Many one-token sessions from one client against a running stack (issue 54, finding 7's must-show).

One-off check, not shipped: start `specserve up` (its defaults: no auth, so the client is
unauthenticated and local), then

    python -m benchmarks session-churn --addr 127.0.0.1:50051 --sessions 3000 --concurrency 16

Each session is a greedy request for one token of a short prompt, through the SDK's AsyncClient with its
defaults (it retries RESOURCE_EXHAUSTED after the server's hint, a bounded number of times). Prints how
many succeeded, how many failed and why, and the sessions per second.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

from specserve.client import AsyncClient


async def churn(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr", default="127.0.0.1:50051")
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--token", default=None, help="an API token (default: none, an unauthenticated client)")
    args = parser.parse_args(argv)
    failures: collections.Counter[str] = collections.Counter()
    done = 0
    gate = asyncio.Semaphore(args.concurrency)
    start = time.perf_counter()
    async with AsyncClient(args.addr, token=args.token) as client:

        async def one(i: int) -> None:
            nonlocal done
            async with gate:
                try:
                    result = await client.generate(f"Say a number: {i}", max_new_tokens=1, temperature=0)
                    assert len(result.token_ids) == 1, result
                    done += 1
                except Exception as exc:
                    failures[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1

        await asyncio.gather(*(one(i) for i in range(args.sessions)))
    elapsed = time.perf_counter() - start
    print(f"{done} of {args.sessions} one-token sessions succeeded in {elapsed:.1f} s "
          f"({args.sessions / elapsed:.1f} sessions/s, concurrency {args.concurrency}); failed: {sum(failures.values())}")
    for reason, n in failures.most_common():
        print(f"  {n} x {reason}")



def main(argv: list[str] | None = None) -> None:
    asyncio.run(churn(argv))
