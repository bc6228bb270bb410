"""Prometheus metrics scraped over HTTP from ``/metrics`` agree with what the roles did.

A local stack (coordinator, draft, target in this process, as ``specserve up``
runs them) and one ``/metrics`` endpoint for the process
(:func:`specserve.runtime.server.start_metrics_server`). Each test scrapes before and
after, and compares the increments with the request's own statistics or the
workers' own replies, so other tests sharing the process registry do not matter
(tests in one process run one at a time).
"""

from __future__ import annotations

import asyncio
import urllib.request
import uuid

import pytest
import pytest_asyncio
import system_fixtures as sf
from prometheus_client.parser import text_string_to_metric_families

from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.coordinator.fleet.clients import DraftCall
from specserve.coordinator.messages import VerifyRequest
from specserve.runtime.server import start_metrics_server
from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 6, 7, 8, 9]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(redis_server, tmp_path_factory):
    pair = sf.tiny_pair(tmp_path_factory)
    async with sf.local_stack(pair, redis_server.url) as s:
        yield s


@pytest.fixture(scope="module")
def metrics_port():
    return start_metrics_server(0, "127.0.0.1")


class Scrape:
    """One scrape of ``/metrics``: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def bucket(self, name: str, le: float) -> float:
        """Cumulative count of histogram ``name`` at upper bound ``le``."""
        for (sample, labels), value in self.samples.items():
            found = dict(labels)
            if sample == f"{name}_bucket" and float(found.get("le", "nan")) == le and len(found) == 1:
                return value
        return 0.0

    def has(self, name: str) -> bool:
        return any(sample == name for sample, _ in self.samples)


async def scrape(port: int) -> Scrape:
    def fetch() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            return reply.read().decode()

    return Scrape(await asyncio.to_thread(fetch))


async def test_speculation_counters_equal_the_requests_own_stats(stack, metrics_port):
    before = await scrape(metrics_port)
    req = sf.request(PROMPT, max_new_tokens=20, gamma=3, ignore_eos=True)
    async with asyncio.timeout(120):
        out = await sf.generate(stack.address, req)
        await stack.coordinator.coordinator.drain()  # the sessions' releases have run
    after = await scrape(metrics_port)
    stats = out.stats
    assert stats is not None and stats.completion_tokens == 20 and stats.proposed_tokens > 0

    def d(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    # Speculation counters (vLLM's names) against GenerationStats.
    assert d("specserve_spec_decode_num_draft_tokens_total") == stats.proposed_tokens
    assert d("specserve_spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert d("specserve_spec_decode_num_wasted_tokens_total") == stats.proposed_tokens - stats.accepted_tokens
    positions = max(len(stats.accepted_per_position), 3)
    per_pos = [
        d("specserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(positions)
    ]
    assert per_pos == list(stats.accepted_per_position) + [0.0] * (
        positions - len(stats.accepted_per_position)
    )
    assert d("specserve_spec_decode_accepted_length_count") == stats.rounds
    assert d("specserve_spec_decode_accepted_length_sum") == stats.completion_tokens
    assert d("specserve_coordinator_committed_tokens_total") == stats.completion_tokens
    assert d("specserve_coordinator_gamma_count") == stats.rounds
    gamma0_rounds = after.bucket("specserve_coordinator_gamma", 0.0) - before.bucket(
        "specserve_coordinator_gamma", 0
    )
    drafts = d("specserve_spec_decode_num_drafts_total")
    assert drafts == stats.rounds - gamma0_rounds and drafts > 0
    assert drafts == stats.draft_rounds
    # The same counters under vLLM's names, for dashboards built for vLLM.
    assert d("vllm:spec_decode_num_drafts_total") == drafts
    assert d("vllm:spec_decode_num_draft_tokens_total") == stats.proposed_tokens
    assert d("vllm:spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert [
        d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(positions)
    ] == per_pos
    assert after.get("vllm:spec_decode_num_draft_tokens_total") == after.get(
        "specserve_spec_decode_num_draft_tokens_total"
    )
    # Requests, latency and stages.
    assert d("specserve_coordinator_requests_total", status="ok") == 1
    assert d("specserve_coordinator_time_to_first_token_seconds_count") == 1
    first_chunk = len(out.chunks[0].token_ids)
    assert (
        d("specserve_coordinator_inter_token_latency_seconds_count") == stats.completion_tokens - first_chunk
    )
    assert d("specserve_coordinator_stage_seconds_count", stage="draft") == drafts
    for stage in ("queue", "verify", "network"):
        assert d("specserve_coordinator_stage_seconds_count", stage=stage) == stats.rounds
    assert d("specserve_coordinator_verify_batch_size_count") == stats.rounds
    assert d("specserve_coordinator_verify_batch_size_sum") == stats.rounds  # alone: one item per call
    assert after.get("specserve_coordinator_active_sessions") == before.get(
        "specserve_coordinator_active_sessions"
    )
    target = stack.coordinator.settings.target_endpoints[0]
    assert after.has("specserve_target_verify_queue_depth")
    assert after.get("specserve_target_verify_queue_depth", target=target) == 0
    # The workers' side of the same rounds.
    assert d("specserve_draft_propose_seconds_count") == drafts
    assert after.get("specserve_draft_queue_depth") == 0
    assert d("specserve_target_forward_seconds_count") == stats.rounds
    assert d("specserve_target_positions_processed_total") >= stats.proposed_tokens + stats.rounds
    assert d("specserve_redis_commit_seconds_count") == stats.rounds
    assert after.get("specserve_target_verify_inflight") == 0
    max_batch = stack.targets[0].settings.max_batch_size
    assert after.get("specserve_target_batch_occupancy") == pytest.approx(1 / max_batch)
    for role, app in (("draft", stack.draft), ("target", stack.targets[0])):
        assert after.get("specserve_worker_cached_sessions", role=role) == len(app.caches)
        assert after.get("specserve_worker_kv_cache_bytes", role=role) == app.caches.total_bytes


async def test_worker_gauges_and_counters_follow_a_live_session(stack, metrics_port):
    """Drive the workers directly (as the coordinator does) and hold the session open between scrapes."""
    pool = stack.coordinator.coordinator.pool
    draft_client = next(iter(pool.draft_clients.values()))
    target_client = next(iter(pool.target_clients.values()))
    draft_caches, target_caches = stack.draft.caches, stack.targets[0].caches
    sid = f"metrics-{uuid.uuid4().hex}"
    sampling = SamplingParams(temperature=0.0, seed=1)
    await stack.coordinator.coordinator.store.create(sid, PROMPT, sampling, StopConditions(max_new_tokens=8))
    base = SessionBase(sid, len(PROMPT), 0)
    before = await scrape(metrics_port)

    proposed = await draft_client.propose_one(
        DraftCall(
            base,
            start_position=0,
            token_ids=PROMPT,
            sampling=sampling,
            gamma=2,
            proposer=common_pb2.PROPOSER_KIND_MODEL,
            draft_top_k=0,
        )
    )
    reply = await target_client.verify([VerifyRequest(base, proposed)])
    assert reply.results[0].verdict is not None
    live = await scrape(metrics_port)

    def d(name: str, **labels: str) -> float:
        return live.get(name, **labels) - before.get(name, **labels)

    assert d("specserve_draft_propose_seconds_count") == 1
    assert d("specserve_target_forward_seconds_count") == 1
    assert d("specserve_target_positions_processed_total") == reply.positions_processed > 0
    assert d("specserve_redis_commit_seconds_count") == 1
    for role, caches in (("draft", draft_caches), ("target", target_caches)):
        assert sid in caches.session_ids()
        assert live.get("specserve_worker_cached_sessions", role=role) == len(caches) >= 1
        assert live.get("specserve_worker_kv_cache_bytes", role=role) == caches.total_bytes > 0

    # A Verify on a stale version is a compare-and-set conflict.
    stale = VerifyRequest(SessionBase(sid, len(PROMPT) + 5, 7))
    reply = await target_client.verify([stale])
    assert reply.results[0].error is not None
    conflicted = await scrape(metrics_port)
    assert conflicted.get("specserve_redis_commit_conflicts_total", reason="stale_base") == (
        live.get("specserve_redis_commit_conflicts_total", reason="stale_base") + 1
    )

    # Releasing the session brings the cache gauges down with the caches.
    assert await draft_client.release(sid) and await target_client.release(sid)
    released = await scrape(metrics_port)
    for role, caches in (("draft", draft_caches), ("target", target_caches)):
        assert sid not in caches.session_ids()
        assert released.get("specserve_worker_cached_sessions", role=role) == len(caches)
        assert released.get("specserve_worker_cached_sessions", role=role) == (
            live.get("specserve_worker_cached_sessions", role=role) - 1
        )
        assert released.get("specserve_worker_kv_cache_bytes", role=role) == caches.total_bytes
    await stack.coordinator.coordinator.store.delete(sid)
