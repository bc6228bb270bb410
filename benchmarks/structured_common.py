"""What the parts of ``python -m benchmarks structured`` share (benchmarks/structured.py, structured_flood.py):
the slow schemas, the requests and their streams, and the inter-token latency summaries (pure)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import string
from collections.abc import AsyncIterator
from typing import Any

from specserve.bench.timing import Streamed, timed_stream

#: The issue's bar: ordinary streams' inter-token latency beside slow compiles within this factor of their solo figure.
ISOLATION_BAR = 1.5


def slow_schema(seed: int, patterns: int) -> dict[str, Any]:
    """A JSON schema that takes llguidance seconds to compile, distinct for each ``seed``: an object
    whose ``patternProperties`` are ``patterns`` regexes with distinct two-letter prefixes. llguidance
    proves them disjoint pair by pair before it accepts them, at a cost that grows about as the cube of
    ``patterns`` (the report gives the seconds one takes alone, measured before the stack starts)."""
    prefixes = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    if not 1 <= patterns <= len(prefixes):
        raise ValueError(f"patterns must be 1..{len(prefixes)}, got {patterns}")
    rng = random.Random(seed)
    chosen = rng.sample(prefixes, patterns)
    tail = rng.choice(("x|yy|zzz", "q|rr|sss", "k|mm|nnn"))
    return {
        "type": "object",
        "patternProperties": {f"^{p}([a-z]|[0-9]{{2}})*({tail})[a-z0-9]{{1,12}}$": {"type": "integer"} for p in chosen},
        "additionalProperties": False,
    }


def render_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn through the tokenizer's chat template (plain tokens where it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer.encode(text))


def constraint_of(schema: dict[str, Any]) -> Any:
    from specserve.api.constraints import Constraint

    return Constraint("json_schema", json.dumps(schema))


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between ranks, as numpy's default); nan for none."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def itl_summary(itls: list[float]) -> dict[str, float]:
    """Median, p90, p99 and max of inter-token latencies (seconds) in ms, and their count."""
    return {
        "n": len(itls),
        "median_ms": 1000 * quantile(itls, 0.5),
        "p90_ms": 1000 * quantile(itls, 0.9),
        "p99_ms": 1000 * quantile(itls, 0.99),
        "max_ms": 1000 * max(itls) if itls else float("nan"),
    }


def isolation_summary(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The ordinary streams' inter-token latencies pooled per condition (``solo``, ``beside``), and beside /
    solo for the median and p90 (the issue's bar: at most :data:`ISOLATION_BAR`). ``phases``: one dict
    per phase with ``condition`` and ``itls`` (seconds)."""
    pooled = {c: [x for p in phases if p["condition"] == c for x in p["itls"]] for c in ("solo", "beside")}
    solo, beside = itl_summary(pooled["solo"]), itl_summary(pooled["beside"])
    return {
        "solo": solo,
        "beside": beside,
        "median_ratio": beside["median_ms"] / solo["median_ms"],
        "p90_ratio": beside["p90_ms"] / solo["p90_ms"],
        "p99_ratio": beside["p99_ms"] / solo["p99_ms"],
    }


class _Flagged:
    """A stream that sets ``first`` when its first chunk with tokens arrives (its ``stats`` once read)."""

    def __init__(self, stream: Any, first: asyncio.Event) -> None:
        self.stream, self.first = stream, first
        self.stats: Any = None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[Any]:
        async for chunk in self.stream:
            if chunk.token_ids:
                self.first.set()
            yield chunk
        self.stats = self.stream.stats


async def stream(
    client: Any, ids: list[int], max_new: int, first: asyncio.Event | None = None, **request: Any
) -> Streamed:
    """One greedy stream, timed at the client; ``first`` is set at its first token."""
    stream = client.stream(prompt_token_ids=ids, max_new_tokens=max_new, temperature=0.0, **request)
    return await timed_stream(stream if first is None else _Flagged(stream, first))


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"
