"""Prometheus metrics of every role, on the default registry.

Names follow Prometheus conventions (``_total`` counters, base units in names).
The speculation counters mirror vLLM's spec-decode metrics: drafts, draft
tokens, accepted tokens, accepted tokens per position, and the wasted
proposals. Those, and the request metrics vLLM has too (running requests,
prompt and generation tokens, time to first token, inter-token latency), are
also exported under vLLM's own names (``vllm:spec_decode_num_drafts_total``,
``vllm:num_requests_running`` ...) by :class:`VllmNames`, so that dashboards
and tools built for vLLM (aiperf reads them from the API port's ``/metrics``)
read them unchanged. Each role updates only its own metrics; a process that hosts all
three roles (``specserve up``) exposes all of them. The gauges the
HorizontalPodAutoscalers scale on are documented in docs/deploy.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SMALL_COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

# --- coordinator: speculation -------------------------------------------------
SPEC_DRAFTS = Counter("specserve_spec_decode_num_drafts", "Rounds that proposed at least one draft token.")
SPEC_DRAFT_TOKENS = Counter("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed.")
SPEC_ACCEPTED_TOKENS = Counter("specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
SPEC_ACCEPTED_PER_POS = Counter(
    "specserve_spec_decode_num_accepted_tokens_per_pos",
    "Draft tokens accepted, by 0-based position in the proposal.",
    ["position"],
)
SPEC_WASTED_TOKENS = Counter(
    "specserve_spec_decode_num_wasted_tokens", "Draft tokens proposed and thrown away (rejected or after a stop)."
)
SPEC_ACCEPTED_LENGTH = Histogram(
    "specserve_spec_decode_accepted_length",
    "Tokens committed per round (accepted + correction/bonus).",
    buckets=_SMALL_COUNT_BUCKETS,
)
GAMMA_CHOSEN = Histogram("specserve_coordinator_gamma", "Gamma chosen per round.", buckets=_SMALL_COUNT_BUCKETS)


# --- coordinator: requests ------------------------------------------------------
ACTIVE_SESSIONS = Gauge("specserve_coordinator_active_sessions", "Generations in progress.")
REQUESTS = Counter("specserve_coordinator_requests", "Generate requests by final status.", ["status"])
COMMITTED_TOKENS = Counter("specserve_coordinator_committed_tokens", "Tokens committed and streamed.")
TIME_TO_FIRST_TOKEN = Histogram(
    "specserve_coordinator_time_to_first_token_seconds", "Request arrival to first token.", buckets=_LATENCY_BUCKETS_S
)
INTER_TOKEN_LATENCY = Histogram(
    "specserve_coordinator_inter_token_latency_seconds",
    "Time between committed tokens (a round's time divided by its tokens).",
    buckets=_LATENCY_BUCKETS_S,
)
STAGE_SECONDS = Histogram(
    "specserve_coordinator_stage_seconds",
    "Per-round time by stage: draft, queue, verify, network.",
    ["stage"],
    buckets=_LATENCY_BUCKETS_S,
)
VERIFY_QUEUE_DEPTH = Gauge(
    "specserve_target_verify_queue_depth", "Sessions waiting for a verify batch (coordinator side).", ["target"]
)
VERIFY_BATCH_SIZE = Histogram(
    "specserve_coordinator_verify_batch_size", "Sessions per Verify call.", buckets=_SMALL_COUNT_BUCKETS
)
PROMPT_TOKENS = Counter("specserve_coordinator_prompt_tokens", "Prompt tokens of the sessions started.")
CONSTRAINT_COMPILES = Counter(
    "specserve_coordinator_constraint_compiles",
    "Constraints of requests by outcome: cached, compiled, invalid (does not compile), timeout, refused "
    "(the compile queue's bounds, or no thread free in time).",
    ["outcome"],
)
CONSTRAINT_COMPILE_JOBS = Gauge(
    "specserve_coordinator_constraint_compile_jobs",
    "Constraint compiles by state: waiting (for a thread), running (a refused compile runs until it ends).",
    ["state"],
)
CONSTRAINT_COMPILE_SECONDS = Histogram(
    "specserve_coordinator_constraint_compile_seconds",
    "Seconds one constraint took to compile (cache misses that compiled).",
    buckets=_LATENCY_BUCKETS_S,
)
REPLICA_FAILURES = Counter("specserve_coordinator_replica_failures", "Worker calls failed by tier.", ["tier"])


# --- workers: the prefix cache (vLLM's names; counted in tokens as vLLM does) ---------------
PREFIX_CACHE_QUERIES = Counter(
    "specserve_prefix_cache_queries",
    "Committed tokens of new session caches looked up in the prefix cache, by role (draft, head, target).",
    ["role"],
)
PREFIX_CACHE_HITS = Counter(
    "specserve_prefix_cache_hits",
    "Of the tokens looked up, those the prefix cache held (attached, not prefilled), by role.",
    ["role"],
)


def prefix_lookup_counter(role: str) -> Callable[[int, int], None]:
    """A store's ``on_lookup``: count ``(queried, hit)`` tokens in the ``role``'s prefix-cache counters."""
    queries, hits = PREFIX_CACHE_QUERIES.labels(role=role), PREFIX_CACHE_HITS.labels(role=role)

    def observe(queried: int, hit: int) -> None:
        queries.inc(queried)
        hits.inc(hit)

    return observe


class VllmNames(Collector):
    """Metrics above exported again under vLLM's metric names (:attr:`ALIASES`).

    Read at scrape time from the metrics themselves, so the two names never disagree.
    vLLM's own series also carry ``model_name`` and ``engine`` labels; add them with a
    scrape-time relabelling where a dashboard filters on them (docs/operations.md).
    """

    ALIASES = (
        (SPEC_DRAFTS, "vllm:spec_decode_num_drafts"),
        (SPEC_DRAFT_TOKENS, "vllm:spec_decode_num_draft_tokens"),
        (SPEC_ACCEPTED_TOKENS, "vllm:spec_decode_num_accepted_tokens"),
        (SPEC_ACCEPTED_PER_POS, "vllm:spec_decode_num_accepted_tokens_per_pos"),
        (ACTIVE_SESSIONS, "vllm:num_requests_running"),
        (PROMPT_TOKENS, "vllm:prompt_tokens"),
        (COMMITTED_TOKENS, "vllm:generation_tokens"),
        (TIME_TO_FIRST_TOKEN, "vllm:time_to_first_token_seconds"),
        (INTER_TOKEN_LATENCY, "vllm:inter_token_latency_seconds"),
        (PREFIX_CACHE_QUERIES, "vllm:prefix_cache_queries"),
        (PREFIX_CACHE_HITS, "vllm:prefix_cache_hits"),
    )

    def collect(self) -> Iterator[Metric]:
        for source, name in self.ALIASES:
            for family in source.collect():
                alias = Metric(name, f"{family.documentation} (vLLM's name)", family.type)
                for sample in family.samples:
                    if sample.name.endswith("_created"):  # vLLM's series have none
                        continue
                    alias.add_sample(name + sample.name[len(family.name) :], sample.labels, sample.value)
                yield alias


REGISTRY.register(VllmNames())

OVERLAP_DRAFTS = Counter(
    "specserve_coordinator_overlap_drafts",
    "Proposals drafted ahead while the target verified (overlap on), by outcome: used (the verdict bore "
    "the hypothesis out: the next round needed no draft call) or wasted.",
    ["outcome"],
)
FEATURE_BYTES = Counter(
    "specserve_coordinator_feature_bytes",
    "Bytes of the target's features (float16 rows for the feature head) on the wire, by hop: from_target "
    "(in Verify replies) or to_draft (in Propose requests that the draft took).",
    ["hop"],
)
PROPOSALS = Counter(
    "specserve_coordinator_proposals",
    "Rounds that proposed, by proposer: a proposal source's name (model, feature, ngram, prediction, forced, ...).",
    ["proposer"],
)
BRANCH_NODES = Counter(
    "specserve_coordinator_branch_nodes",
    "Nodes a source's free guess added to another source's draft tree (the hybrid lookup's, on the feature "
    "head's trees).",
    ["source"],
)
DRAFT_EXPANSION_PASSES = Counter(
    "specserve_coordinator_draft_expansion_passes",
    "Passes the draft ran to expand draft trees below their alternatives (ProposeResponse.expansion_passes), "
    "beyond one per chain token.",
)
SOURCE_TOKENS = Counter(
    "specserve_coordinator_source_tokens",
    "Draft tokens per proposal source (a source's name), proposed and accepted.",
    ["source", "outcome"],
)
PREDICTION_TOKENS = Counter(
    "specserve_coordinator_prediction_tokens",
    "Predicted Outputs: prediction tokens accepted (in the completion) or rejected (drafted, not committed).",
    ["outcome"],
)
PROPOSE_BATCH_SIZE = Histogram(
    "specserve_coordinator_propose_batch_size", "Sessions per ProposeBatch call.", buckets=_SMALL_COUNT_BUCKETS
)
PROPOSE_QUEUE_DEPTH = Gauge(
    "specserve_coordinator_propose_queue_depth",
    "Sessions waiting for a ProposeBatch call to leave (coordinator side).",
    ["draft"],
)

# --- draft ------------------------------------------------------------------------
DRAFT_QUEUE_DEPTH = Gauge(
    "specserve_draft_queue_depth", "Sessions waiting for the draft model or being drafted on this replica."
)
DRAFT_BATCH_OCCUPANCY = Gauge(
    "specserve_draft_batch_occupancy", "Sessions of the last drafting pass divided by max_batch_size (0..1)."
)
DRAFT_BATCH_SIZE = Histogram(
    "specserve_draft_batch_size",
    "Sessions drafted together (one forward pass per draft step).",
    buckets=_SMALL_COUNT_BUCKETS,
)
DRAFT_SECONDS = Histogram(
    "specserve_draft_propose_seconds", "Time of one Propose or ProposeBatch call.", buckets=_LATENCY_BUCKETS_S
)

# --- target -----------------------------------------------------------------------
TARGET_BATCH_OCCUPANCY = Gauge(
    "specserve_target_batch_occupancy", "Items of the last Verify call divided by max_batch_size (0..1)."
)
TARGET_INFLIGHT = Gauge("specserve_target_verify_inflight", "Verify calls in flight on this target replica.")
TARGET_FORWARD_SECONDS = Histogram(
    "specserve_target_forward_seconds", "Batched forward pass time.", buckets=_LATENCY_BUCKETS_S
)
TARGET_POSITIONS = Counter("specserve_target_positions_processed", "Positions fed through the target model.")
COMMIT_SECONDS = Histogram(
    "specserve_redis_commit_seconds", "Redis compare-and-set commit latency.", buckets=_LATENCY_BUCKETS_S
)
COMMIT_CONFLICTS = Counter("specserve_redis_commit_conflicts", "Commits refused by compare-and-set.", ["reason"])

# --- workers (draft and target) -------------------------------------------------
CACHED_SESSIONS = Gauge("specserve_worker_cached_sessions", "Sessions holding a KV cache.", ["role"])
KV_CACHE_BYTES = Gauge("specserve_worker_kv_cache_bytes", "Bytes of KV cache held.", ["role"])
