"""benchmarks.prefix_cache: the memory check at a small size, and the report's arithmetic."""

from __future__ import annotations

import pytest

from benchmarks import prefix_cache
from benchmarks.options import PrefixCacheMemoryOptions

pytestmark = pytest.mark.unit


def test_the_memory_check_stays_in_its_budget_and_finds_only_the_recent_prompts(tmp_path):
    args = PrefixCacheMemoryOptions(prefixes=24, tokens=64, keep=4, memory_model="tiny", out=tmp_path)
    got = prefix_cache._memory(args)
    assert got["most_store_bytes"] <= got["budget_bytes"] == 4 * 64 * got["kv_bytes_per_token"]
    assert got["recent_whole_hits"] == got["recent_tried"] == 2
    assert got["oldest_hits"] == 0 and got["blocks_evicted"] > 0


def test_the_summary_compares_the_last_turn_with_a_fresh_request_and_the_cache_off():
    runs = [
        {
            "turn": t,
            "mode": m,
            "prompt_tokens": 100 * t,
            "new_tokens": 100,
            "cached_tokens": 0,
            "ttft_ms": ms,
            "identical": True,
            "repeat": 0,
        }
        for t in (1, 2)
        for m, ms in (("on", 10.0 * t), ("off", 30.0 * t))
    ]
    runs += [
        {
            "turn": "fresh",
            "mode": m,
            "prompt_tokens": 100,
            "new_tokens": 100,
            "cached_tokens": 0,
            "ttft_ms": 16.0,
            "repeat": 0,
        }
        for m in ("on", "off")
    ]
    s = prefix_cache._summary(runs, 2)
    assert s["last_on_over_fresh"] == pytest.approx(20.0 / 16.0)
    assert s["last_off_over_on"] == pytest.approx(3.0)
    assert s["identical"]
    text = prefix_cache.render(
        {"summary": s, "args": {"repeats": 1, "turns": 2, "answer_tokens": 64, "user_tokens": 160}}, None
    )
    assert "**1.25x**" in text and "**3.00x**" in text
    # A run cut short (turn 2 ran with the cache on only, no fresh request): what both modes reached.
    cut = prefix_cache._summary([r for r in runs if r["turn"] == 1 or (r["turn"] == 2 and r["mode"] == "on")], 2)
    assert [r["turn"] for r in cut["per_turn"]] == [1] and cut["last_on_over_fresh"] is None
    assert cut["last_off_over_on"] == pytest.approx(3.0)
