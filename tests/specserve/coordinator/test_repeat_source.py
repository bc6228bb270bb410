"""The opt-in ``repeat`` source (``specserve/coordinator/speculation/sources/repeat_last.py``), the proof that a
proposal source is one module and one registration: opted in, it drafts the tiny target's looping continuations
and shows by its name in ``GenerationStats.sources``, the Prometheus counter and the HTTP replies' ``speculation``,
with nothing else edited; the greedy output stays the target's own."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio
import system_fixtures as sf
from prometheus_client import REGISTRY
from worker_fakes import speculator_for

from specserve import AsyncClient
from specserve.api.params import SamplingParams, StopConditions
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.sources import check_opt_in
from specserve.v1 import common_pb2

MAX_NEW = 32
# The tiny target's greedy continuations of these fall into runs of one token (test_hybrid_lookup.py).
PROMPTS = ([142] * 8, [160] * 8, [31] * 8)


def _session(gamma: int | None) -> Session:
    speculation = SpeculationSettings(gamma=gamma, proposer=common_pb2.PROPOSER_KIND_MODEL)
    return Session("s", [5, 6, 7], SamplingParams(temperature=0.0), StopConditions(), speculation)


@pytest.mark.unit
def test_the_source_is_built_only_where_opted_in_under_the_adaptive_policy():
    assert speculator_for(_session(None)).source("repeat") is None
    assert speculator_for(_session(None), opt_in_sources=["repeat"]).source("repeat") is not None
    assert speculator_for(_session(2), opt_in_sources=["repeat"]).source("repeat") is None
    with pytest.raises(ValueError, match="not opt-in proposal sources"):
        check_opt_in(["repeat", "oracle"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    overrides = {"opt_in_sources": ["repeat"], "http_port": 0, "served_model_name": "tiny"}
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=overrides) as s:
        yield s


def _repeat_tokens(outcome: str) -> float:
    return REGISTRY.get_sample_value(
        "specserve_coordinator_source_tokens_total", {"source": "repeat", "outcome": outcome}
    ) or 0.0


@pytest.mark.asyncio(loop_scope="module")
async def test_the_source_drafts_and_shows_in_stats_metrics_and_the_openai_reply(stack, pair):
    before = _repeat_tokens("proposed")
    drafted = 0
    async with AsyncClient(stack.address) as client:
        for prompt in PROMPTS:
            kw = {"prompt_token_ids": prompt, "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
            result = await client.generate(hybrid_lookup=False, **kw)
            assert list(result.token_ids) == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
            rows = {s.name: s for s in result.stats.sources}
            assert list(rows) == ["repeat", "model"], "every source of the session, in the order it asks them"
            repeat = rows["repeat"]
            assert repeat.accepted_tokens <= repeat.proposed_tokens
            assert sum(r.proposed_tokens for r in rows.values()) == result.stats.proposed_tokens
            drafted += repeat.proposed_tokens
    assert drafted > 0, "the runs of one token were drafted by the repeat source"
    assert _repeat_tokens("proposed") - before == drafted
    http_drafted = 0
    async with httpx.AsyncClient(base_url=stack.coordinator.http.url, timeout=120) as http:
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
            body["speculation"] = {"hybrid_lookup": False}
            reply = (await http.post("/completions", json=body)).json()
            speculation = reply["speculation"]
            assert set(speculation["sources"]) == {"repeat", "model"}, speculation
            assert sum(s["num_draft_tokens"] for s in speculation["sources"].values()) == speculation["num_draft_tokens"]
            http_drafted += speculation["sources"]["repeat"]["num_draft_tokens"]
    assert http_drafted > 0
