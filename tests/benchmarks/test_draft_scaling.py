"""benchmarks.draft_scaling: the draft-scaling mode on the tiny pair through real local stacks (batching on and
off), its summary and its report section."""

from __future__ import annotations

import pytest
import system_fixtures as sf

from benchmarks.draft_scaling import draft_scaling_section, measure, summarize, to_json, write_draft_scaling


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


async def test_the_mode_measures_both_settings_and_renders_them(pair, redis_server, tmp_path):
    prompts = [pair.tokenizer.encode(t, add_special_tokens=False) for t in ("def add(a, b):\n", "the quick")]
    runs = await measure(
        target=pair.target_dir,
        draft=pair.draft_dir,
        redis_url=redis_server.url,
        prompts=prompts,
        sessions=(1, 3),
        gamma=2,
        max_new_tokens=6,
        device="cpu",
        dtype="float32",
    )
    assert [(r.batching, r.sessions) for r in runs] == [(True, 1), (True, 3), (False, 1), (False, 3)]
    for r in runs:
        assert r.errors == 0 and r.tokens == 6 * r.sessions and r.rounds > 0
        assert r.draft_ms_per_round > 0 and r.verify_ms_per_round > 0 and r.throughput_tok_s > 0
    off = [r for r in runs if not r.batching]
    assert all(r.draft_batches == r.draft_items > 0 for r in off)  # batching off: every session alone
    rows = summarize(runs)
    assert [(row["batching"], row["sessions"]) for row in rows] == [
        (True, 1),
        (True, 3),
        (False, 1),
        (False, 3),
    ]
    data = to_json(
        runs,
        {
            "gamma": 2,
            "max_new_tokens": 6,
            "repeats": 1,
            "date_utc": "now",
            "target": "t",
            "draft": "d",
            "draft_batch": 32,
        },
    )
    text = "\n".join(draft_scaling_section(data))
    assert "| 3 |" in text and "draft ms/round on" in text
    path = write_draft_scaling(data, tmp_path)
    assert path.read_text().startswith("## The draft tier") and (tmp_path / "draft_scaling.png").exists()
