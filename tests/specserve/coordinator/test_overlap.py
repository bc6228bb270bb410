"""Overlap (proactive drafting, ``CoordinatorSettings.overlap``) through the whole system: real Redis,
real gRPC, the tiny pair. An ahead draft is used only when the verdict bears its hypothesis out, and it
is then the very proposal a Propose would have returned, so the output is the same token for token as
with overlap off: greedy, and sampled at a fixed gamma with a seed (both sampling modes)."""

from __future__ import annotations

import pytest
import system_fixtures as sf
from prometheus_client import REGISTRY

from specserve.v1 import common_pb2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def self_pair(pair):
    """The target as its own draft: greedy proposals are always accepted, so every hypothesis can hold."""
    return sf.TinyPair(pair.target_dir, pair.target_dir)


def _overlap(outcome: str) -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_overlap_drafts_total", {"outcome": outcome}) or 0.0


REQUESTS = [
    dict(temperature=0.0, gamma=3),
    dict(temperature=0.0, gamma=None),
    dict(temperature=0.9, seed=11, gamma=3),
    dict(temperature=0.9, seed=12, gamma=2, sampling_mode=common_pb2.SAMPLING_MODE_COUPLED),
    dict(temperature=0.8, top_k=20, seed=13, gamma=4, draft_top_k=16),
]


async def _outputs(pair, redis_url, *, overlap: bool) -> list[list[int]]:
    out = []
    async with sf.local_stack(pair, redis_url, coordinator_overrides={"overlap": overlap}) as stack:
        for i, kw in enumerate(REQUESTS):
            got = await sf.generate(stack.address, sf.request([5 + i, 17, 42, 9], max_new_tokens=40, **kw))
            assert got.stats is not None and len(got.token_ids) > 0
            out.append(got.token_ids)
    return out


@pytest.mark.parametrize("which", ["tiny pair", "target as its own draft"])
async def test_overlap_changes_no_token(pair, self_pair, redis_server, which):
    p = pair if which == "tiny pair" else self_pair
    off = await _outputs(p, redis_server.url, overlap=False)
    used, wasted = _overlap("used"), _overlap("wasted")
    on = await _outputs(p, redis_server.url, overlap=True)
    assert on == off
    drafted_ahead = (_overlap("used") - used) + (_overlap("wasted") - wasted)
    assert drafted_ahead > 0, "overlap on must draft ahead"
    if which == "target as its own draft":
        assert _overlap("used") - used > 0, "with a draft equal to the target, greedy hypotheses hold"


async def test_overlap_off_drafts_nothing_ahead(pair, redis_server):
    before = _overlap("used") + _overlap("wasted")
    await _outputs(pair, redis_server.url, overlap=False)
    assert _overlap("used") + _overlap("wasted") == before
