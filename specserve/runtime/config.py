"""Settings of each role, built once at start-up and passed down.

Each role has one settings class. Values come from keyword arguments (the CLI
flags), then from environment variables named ``SPECSERVE_<FIELD>`` in upper
case (``SPECSERVE_REDIS_URL``, ``SPECSERVE_TARGET_ENDPOINTS``; lists are
comma-separated), then the defaults below. Nothing is read at import time;
classes check themselves on construction and raise ``ValueError`` (pydantic's
``ValidationError``) saying what to fix.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

CommaList = Annotated[list[str], NoDecode]


def _split_commas(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def describe_errors(exc: Exception) -> str:
    """A settings validation error as ``field: what is wrong`` lines, never quoting an input value.

    pydantic's own text repeats the inputs (``input_value=...``), which would print secrets (tokens,
    the Redis URL's password) wherever the message goes; this is the text to show instead.
    """
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return type(exc).__name__
    lines = []
    for error in errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error.get("loc", ())) or "settings"
        lines.append(f"  {where}: {error.get('msg', 'invalid')}")
    return "\n".join(lines) or type(exc).__name__


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``): reachable only
    from this machine. ``0.0.0.0``, ``::`` and every other name are not."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def features_call_bytes(setting: int | None, max_message_bytes: int) -> int:
    """A ``features_per_call_bytes`` setting resolved (unset: a quarter of ``max_message_bytes``); raises
    ``ValueError`` above half of it, where the rest of a message might no longer fit."""
    if setting is None:
        return max(1, max_message_bytes // 4)
    if setting > max_message_bytes // 2:
        raise ValueError(
            f"features_per_call_bytes={setting} leaves too little of max_message_bytes={max_message_bytes} for "
            f"the rest of a message; set it to at most {max_message_bytes // 2}, or unset it (a quarter)"
        )
    return setting


class CommonSettings(BaseSettings):
    """What every role's server needs."""

    model_config = SettingsConfigDict(env_prefix="SPECSERVE_", extra="forbid", validate_default=True)

    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics HTTP port; unset disables, 0 picks one."
    )
    log_format: Literal["json", "console"] = Field("console", description="structlog renderer.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis holding the committed prefixes; rediss:// for TLS, password in the URL.",
    )
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest gRPC message.")
    shutdown_grace_s: float = Field(10.0, ge=0, description="Drain time after SIGTERM.")
    tls_cert_file: Path | None = Field(None, description="PEM certificate this server presents.")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_ca_file: Path | None = Field(
        None, description="PEM CA bundle; on a server it turns on mutual TLS (client certificates required)."
    )
    keepalive_time_s: float = Field(
        30.0, gt=0, description="The server pings every client connection this often (HTTP/2 keepalive)."
    )
    keepalive_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection that does not answer a keepalive ping within this is closed and its calls "
        "cancelled (a vanished client's sessions end and release their caches).",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> CommonSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_ca_file (mutual TLS) needs tls_cert_file and tls_key_file too")
        return self

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None


class WorkerSettings(CommonSettings):
    """What the draft and the target share: a model and a session cache."""

    model: str | None = Field(
        None,
        description="Registered model name (`specserve models list`), local model directory, or hub id; "
        "unset: the default pair.",
    )
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': bfloat16 on CUDA, float32 on CPU."
    )
    max_gamma: int = Field(16, ge=0, le=64, description="Largest number of draft tokens per round.")
    max_sessions: int = Field(
        256, ge=1, description="Sessions kept in the KV-cache store before LRU eviction."
    )
    kv_budget_bytes: int = Field(4 * 1024**3, ge=1, description="KV-cache memory budget before LRU eviction.")
    session_ttl_s: float = Field(600.0, gt=0, description="Idle sessions are released after this long.")
    prefix_cache: bool = Field(
        True,
        description="Share committed KV between sessions that start with the same tokens (the prefix cache, "
        "in kv_budget_bytes): a new session prefills only what no earlier one computed "
        "(docs/operations.md, 'Sizing the prefix cache'). Off (--no-prefix-cache): every session prefills "
        "its whole prompt.",
    )
    prefix_block_tokens: int = Field(
        16, ge=1, le=4096, description="Tokens per shared block of the prefix cache (a prompt's last partial "
        "block is never shared)."
    )
    max_session_tokens: int = Field(
        32768,
        ge=1,
        description="Most committed tokens a session may hold here (also capped by the model's context); "
        "a longer Propose history is refused before any work.",
    )
    kernels: Literal["fastest", "auto", "stock", "onednn"] = Field(
        "fastest",
        description="Linear-layer kernels: 'fastest' (for float32 on a CPU where PyTorch has oneDNN, both "
        "paths timed on the model as it loads, a step and a pass over 5 positions, and the faster kept, "
        "logged as kernels_timed; elsewhere stock), 'onednn' (weights prepacked for oneDNN, on a CPU: a pass "
        "over several positions costs little more than one), 'stock' (PyTorch's), 'auto' (onednn for "
        "float32 on a CPU where PyTorch has it, else stock). Which is faster depends on the CPU "
        "(docs/benchmarks/kernels.md).",
    )
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads for the model's passes (torch's intra-op threads on the model thread); 0: "
        "torch's default, one per core. `specserve up` and `demo` give their draft 1: it shares the cores with "
        "the target there, and a second thread team costs the target's passes more than it saves the draft "
        "(docs/operations.md, the paragraph on `threads`).",
    )
    warmup: bool = Field(True, description="Run one forward pass at start so the first request is not slow.")
    worker_token: SecretStr | None = Field(
        None,
        description="Shared secret every caller must send as 'authorization: Bearer <token>' (the "
        "coordinator's worker_token); others get UNAUTHENTICATED / PERMISSION_DENIED.",
    )
    tls_client_names: CommaList = Field(
        default_factory=list,
        description="With tls_ca_file (mutual TLS): the client certificate names (common name or DNS SAN) "
        "allowed to call, e.g. the coordinator's; a certificate from the CA with another name gets "
        "PERMISSION_DENIED.",
    )
    insecure: bool = Field(
        False,
        description="Listen on a non-loopback address with neither worker_token nor tls_client_names: "
        "anyone who reaches the port can commit tokens into sessions. Off: such a worker refuses to start.",
    )

    @field_validator("model", mode="before")
    @classmethod
    def _path_to_str(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    @field_validator("tls_client_names", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return _split_commas(value)

    @model_validator(mode="after")
    def _callers_authenticated(self) -> WorkerSettings:
        if self.tls_client_names and self.tls_ca_file is None:
            raise ValueError("tls_client_names (pinned client certificates) needs tls_ca_file (mutual TLS)")
        if self.worker_token is not None and not self.worker_token.get_secret_value():
            raise ValueError("worker_token must not be empty (unset it to turn token authentication off)")
        if not (is_loopback(self.host) or self.authenticates_callers or self.insecure):
            raise ValueError(
                f"this worker would listen on {self.host}, beyond this machine, without authenticating its "
                "callers: anyone reaching the port could commit tokens into sessions. Set worker_token "
                "(SPECSERVE_WORKER_TOKEN, the same on the coordinator), or tls_ca_file with "
                "tls_client_names (mutual TLS, the coordinator's certificate name), or listen on 127.0.0.1; "
                "insecure=true (--insecure) accepts anyone"
            )
        return self

    @property
    def authenticates_callers(self) -> bool:
        """A worker token, or mutual TLS pinned to client names, is configured."""
        return self.worker_token is not None or bool(self.tls_client_names)


class DraftSettings(WorkerSettings):
    """The draft service."""

    port: int = Field(50053, ge=0, le=65535)
    kernels: Literal["auto", "stock", "onednn"] = Field(
        "auto",
        description="Kernels of the drafting passes' linear layers: 'onednn' (weights prepacked for oneDNN, "
        "on a CPU: the rows of a pass go unpadded where the kernel's bits do not depend on the row count, so "
        "a lone session's step costs one row's matmul, not a 16-row block's), 'stock' (PyTorch's, in "
        "16-row blocks), 'auto' (onednn for float32 on a CPU where PyTorch has it, else stock). What each costs "
        "per drafted token: docs/benchmarks/kernels.md.",
    )
    max_batch_size: int = Field(
        32,
        ge=1,
        description="Most sessions drafted in one forward pass (and per ProposeBatch call); 1: each alone.",
    )
    feature_head: str | None = Field(
        None,
        description="The feature head (docs/design.md, 'The feature head'): a registered name or a directory; "
        "'none' serves without one. Unset: the default pair's head when the draft is the default draft and "
        "the head is present.",
    )
    feature_head_target: str | None = Field(
        None,
        description="Where the feature head takes its target's token table from (a registered name or a "
        "directory; only that table is read). Unset: the target its config names.",
    )


class TargetSettings(WorkerSettings):
    """The target service."""

    port: int = Field(50052, ge=0, le=65535)
    kernels: Literal["fastest", "auto", "stock", "onednn"] = Field(
        "auto",
        description="Linear-layer kernels: 'auto' (on a CPU in float32, the faster of PyTorch's and packed "
        "oneDNN for this kind of CPU and model shape, timed by the first replica of the kind to start and "
        "recorded in the deployment's Redis, so every replica of a kind runs the same path; elsewhere stock), "
        "'onednn' (weights prepacked for oneDNN, on a CPU), 'stock' (PyTorch's), 'fastest' (only with "
        "invariant off: both paths timed in each process, so two replicas may differ; "
        "docs/benchmarks/kernels.md).",
    )
    invariant: bool = Field(
        False,
        description="Invariant passes (--invariant; docs/design.md, 'Numerics'): a position's logits are the "
        "same bits from a decoding step, a verify pass, a prefill, any batch-mates and padding, and any "
        "replica with the same software, CPU kind and kernels, so greedy output is the target alone's token "
        "for token with no exception for near-ties, and a coupled session's text survives batch-mates and "
        "failover bit for bit. They cost speed (docs/benchmarks/invariance.md), so they are opt-in, as vLLM's "
        "batch-invariant mode is. Off (the default): transformers' attention and the kernels' own row "
        "handling; a position's logits agree across those to float rounding, so output equals the target "
        "alone's except where two tokens' logits lie within that rounding.",
    )
    max_batch_size: int = Field(32, ge=1, description="Most sessions in one Verify call.")
    feature_head: str | None = Field(
        None,
        description="The feature head the draft tier serves (a registered name or a directory; only its "
        "config.json and fuse matrix are read): this target makes the feature it reads, a fused head's "
        "projected here (docs/design.md, 'The feature head'). 'none': the last layer's feature. Unset: the "
        "default pair's head when the target is the default target and the head is present, else 'none'. A "
        "coordinator refuses to start where a draft's head reads another feature than this.",
    )
    features_per_call_bytes: int | None = Field(
        None,
        ge=1024,
        description="Most bytes of the target's features (for the feature head) in one Verify reply, its items "
        "together, shared fairly; a session's rows that do not fit come with its next calls (it drafts with "
        "the head once they are all there). Unset: a quarter of max_message_bytes; at most half of it.",
    )
    measure_verify_cost: bool = Field(
        True,
        description="Time one session's verify pass for 1..max_gamma+1 positions at start-up (a few seconds "
        "on a CPU) and report it in GetTargetInfo, so the coordinator knows what speculation costs here.",
    )

    @model_validator(mode="after")
    def _one_kernel_path(self) -> TargetSettings:
        if self.invariant and self.kernels == "fastest":
            raise ValueError(
                "kernels='fastest' picks a kernel path by timing in each process, so replicas could compute "
                "different bits; with invariant passes choose kernels 'auto', 'onednn' or 'stock' (the same on "
                "every replica), or turn invariant off (--no-invariant)"
            )
        features_call_bytes(self.features_per_call_bytes, self.max_message_bytes)
        return self

    @property
    def feature_bytes_per_call(self) -> int:
        """``features_per_call_bytes`` resolved (unset: a quarter of ``max_message_bytes``)."""
        return features_call_bytes(self.features_per_call_bytes, self.max_message_bytes)


class CoordinatorSettings(CommonSettings):
    """The client-facing coordinator."""

    port: int = Field(50051, ge=0, le=65535)
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions); "
        "unset disables it, 0 picks a free one.",
    )
    served_model_name: str | None = Field(
        None, description="Model id the HTTP API lists and accepts; unset: the tokenizer directory's name."
    )
    http_unknown_fields: Literal["refuse", "ignore"] = Field(
        "refuse",
        description="A request field the HTTP API does not know: refuse it with a 400 naming it (catches "
        "typos), or ignore it with a warning in the log (vLLM's behaviour).",
    )
    draft_endpoints: CommaList = Field(default_factory=list, description="host:port of each draft replica.")
    target_endpoints: CommaList = Field(
        default_factory=list, description="host:port of each target replica (sessions stick to one)."
    )
    tokenizer: str | None = Field(
        None,
        description="The target's tokenizer: registered model name, directory or hub id; unset: the default target.",
    )
    max_batch_size: int = Field(16, ge=1, description="Most sessions gathered into one Verify call.")
    max_batch_wait_ms: float = Field(
        2.0, ge=0, description="Longest a round waits for others to join its batch."
    )
    draft_max_batch_size: int = Field(
        32,
        ge=1,
        description="Most sessions gathered into one ProposeBatch call (lowered to the drafts' own "
        "max_batch_size); 1 sends every proposal on its own (no draft batching).",
    )
    draft_batch_wait_ms: float = Field(
        2.0, ge=0, description="Longest a round waits for others to join its ProposeBatch call."
    )
    default_max_new_tokens: int = Field(256, ge=1)
    max_new_tokens_limit: int = Field(4096, ge=1, description="Requests asking for more are refused.")
    max_prompt_tokens: int = Field(8192, ge=1)
    max_prompt_bytes: int = Field(
        256 * 1024, ge=1, description="Largest text prompt in UTF-8 bytes, refused before it is tokenized."
    )
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings one request may send.")
    max_stop_string_chars: int = Field(128, ge=1, description="Longest stop string, in characters.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop token ids one request may send.")
    constraint_compile_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest a request's constraint may take to compile, counted from when a thread takes it "
        "(longer is refused, INVALID_ARGUMENT), and longest it may wait for a thread (RESOURCE_EXHAUSTED).",
    )
    constraint_compile_threads: int = Field(
        2,
        ge=2,
        description="Threads compiling constraints, off the event loop at the lowest CPU priority. A client's "
        "compiles run one at a time, so another client's finds a thread free unless this many clients compile.",
    )
    constraint_compile_queue: int = Field(
        64, ge=1, description="Constraint compiles waiting for a thread, all clients; more are RESOURCE_EXHAUSTED."
    )
    constraint_compile_queue_per_client: int = Field(
        8,
        ge=1,
        description="Constraint compiles one client may have waiting or running (a compile past its time limit "
        "counts until it ends); more are RESOURCE_EXHAUSTED before they start.",
    )
    constraint_cache_size: int = Field(256, ge=1, description="Compiled constraints kept (most recently used).")
    max_sessions: int = Field(512, ge=1, description="Concurrent sessions in total.")
    max_sessions_per_client: int = Field(
        64,
        ge=1,
        description="Concurrent sessions per client: an authenticated identity (bearer token or client "
        "certificate name), or an address with client_limits_by_address.",
    )
    session_rate_per_client: float = Field(
        20.0,
        gt=0,
        allow_inf_nan=False,
        description="New sessions per second one client (as for max_sessions_per_client) may start, sustained "
        "(a token bucket refilled at this rate); past it a request is refused with RESOURCE_EXHAUSTED (HTTP "
        "429) and a retry hint of the bucket's wait for its next session.",
    )
    session_burst_per_client: int = Field(
        200, ge=1, description="New sessions one client may start at once before session_rate_per_client applies."
    )
    client_limits_by_address: bool = Field(
        False,
        description="Apply the per-client limits (max_sessions_per_client, session_rate_per_client) to callers "
        "no token or client certificate names, by network address (IPv4 address, IPv6 /64). Off: such "
        "callers are limited by max_sessions only (every caller behind one proxy or NAT would share an "
        "address; see trusted_proxies).",
    )
    trusted_proxies: CommaList = Field(
        default_factory=list,
        description="With client_limits_by_address: addresses or networks (CIDR) of proxies in front of this "
        "coordinator whose X-Forwarded-For header names the caller's address; the header is ignored from "
        "any other peer.",
    )
    keep_ended_sessions_s: float = Field(
        0.0,
        ge=0,
        description="How long a session's log stays in Redis once the session has ended (finished, cancelled "
        "or failed); 0 deletes its keys at once. While a session runs its keys stay (replays and failover "
        "read them); a session whose coordinator vanished expires after the store's TTL.",
    )
    max_gamma: int = Field(
        16,
        ge=0,
        le=64,
        description="Largest gamma a request may ask for and the policy may pick (at most the workers' own, "
        "which are 16 by default).",
    )
    decode_steps: int = Field(
        4,
        ge=1,
        le=16,
        description="Target steps per Verify call in a round that runs the target alone (gamma = 0), after "
        "the first token: each step commits exactly what a gamma = 0 round would, and the call saves the "
        "round trips, commits and coordinator work of the steps after the first (vLLM's multi-step "
        "scheduling). A probe out of gamma 0 takes them too, after its proposal's verdict. Tokens of such a "
        "round reach the client together; 1 streams each on its own.",
    )
    hybrid_lookup: bool = Field(
        True,
        description="Sessions that draft with the model under the adaptive policy also keep an n-gram index "
        "of their own tokens (prompt lookup) and draft a round from it, with no draft call, when its own "
        "acceptance (learnt from every round's committed tokens) makes that pay more than the draft model "
        "or the target alone: copied text is drafted from the lookup, the rest by the model.",
    )
    opt_in_sources: CommaList = Field(
        default_factory=list,
        description="Proposal sources that are off unless named here (the opt-in ones registered in "
        "specserve/coordinator/speculation/sources/): 'repeat' drafts the last token again, with no draft "
        "call, only where its own acceptance, learnt from every round, makes that pay; 'tree' drafts a "
        "draft-model session's rounds as draft trees, the model's chain with the n-gram lookup's "
        "continuation as a branch (docs/design.md, 'Draft trees: exact acceptance').",
    )
    draft_min_confidence: float = Field(
        0.4,
        ge=0.0,
        lt=1.0,
        description="Dynamic draft length under the adaptive policy: the draft model ends a round's "
        "proposal after the first token it drafted with probability below this under its own distribution "
        "(the policy's gamma is then a cap), so rounds draft far where the draft is sure and stop where it "
        "is not (HF's assistant_confidence_threshold, 0.4 there too). 0 drafts the whole gamma. A request "
        "may set its own (SpeculationParams.min_confidence). Exactness is kept at any value.",
    )
    draft_tree_nodes: int = Field(
        8,
        ge=0,
        le=255,
        description="Draft trees from the feature head's own ranking: the most alternatives (next-best tokens "
        "of the head's distribution, point-mass siblings of its chain's tokens) a round adds to the chain. "
        "Under the adaptive policy an alternative is added only where its path probability beats what one "
        "more verified position costs, from the cost model, with a margin (docs/design.md, 'Draft trees "
        "from the draft's ranking'); a fixed gamma drafts chains unless draft_tree_min_path_probability is "
        "set. 0: chains. Constrained sessions always draft chains. Exactness is kept at any value.",
    )
    draft_tree_min_path_probability: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Fixes the path probability a feature-head tree's alternative needs, for every policy "
        "(a fixed gamma included), instead of the adaptive policy's break-even from the cost model: for "
        "tests and measurements. 1: chains. Unset: the policy decides.",
    )
    default_proposer: Literal["auto", "model", "feature"] = Field(
        "auto",
        description="The proposer of a request that names none: 'model' (the token draft), 'feature' (the "
        "feature head, docs/design.md 'The feature head'), or 'auto': the feature head when every draft "
        "replica serves one, else the token draft. The default pair's head beats its token draft on held-out "
        "chat and code (docs/benchmarks/single.md), so 'auto' is the default.",
    )
    features_per_call_bytes: int | None = Field(
        None,
        ge=1024,
        description="Most bytes of the target's features in one Propose or ProposeBatch call to a draft "
        "replica (the feature head's input), its items together; a session's rows that do not fit go with "
        "its next rounds, which run at gamma 0 until they are all there. Unset: a quarter of "
        "max_message_bytes; at most half of it.",
    )
    features_per_session_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        description="Most bytes of the target's features the coordinator keeps for one session on their way "
        "to the draft (and asks the target for in one call). Past it the oldest rows go and the draft "
        "rebuilds the head's context from the newest (docs/design.md, 'The feature head').",
    )
    overlap: bool = Field(
        False,
        description="Proactive drafting: while the target verifies a round, the draft already drafts the "
        "next one on the hypothesis that the whole proposal is accepted and the bonus token is the "
        "draft's own guess; used only when the verdict bears the hypothesis out (the proposal is then "
        "the very one the draft would have sent), thrown away otherwise.",
    )
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of each call to a worker.")
    draft_timeout_s: float = Field(
        5.0, gt=0, description="Deadline of each Propose; a slower draft makes that round run at gamma 0."
    )
    auth_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Bearer tokens accepted from clients; empty disables auth."
    )
    worker_tls_ca_file: Path | None = Field(None, description="CA that signed the workers' certificates.")
    worker_tls_cert_file: Path | None = Field(
        None, description="Client certificate for mutual TLS to workers."
    )
    worker_tls_key_file: Path | None = Field(None, description="Key of worker_tls_cert_file.")
    worker_token: SecretStr | None = Field(
        None, description="Shared secret sent to every worker as 'authorization: Bearer <token>' (theirs)."
    )
    stream_idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A Generate stream whose client takes no message for this long (its flow-control window "
        "stays full) is cancelled: the session ends and its caches are released.",
    )
    lease_ttl_s: float = Field(
        30.0,
        gt=0,
        description="A session's owner lease in Redis; renewed every third of it while rounds run.",
    )
    max_verify_attempts: int = Field(
        6,
        ge=1,
        description="Verify calls one round may make (failover and retries) before its session fails.",
    )
    all_down_wait_s: float = Field(
        15.0,
        ge=0,
        description="Longest a round waits while every target replica backs off before its session fails "
        "(keep it above target_max_backoff_s, so a replica that recovers is tried first).",
    )
    draft_backoff_s: float = Field(
        1.0, gt=0, description="A failed draft replica is skipped this long; doubles per failure in a row."
    )
    draft_max_backoff_s: float = Field(30.0, gt=0, description="Cap of the draft replicas' back-off.")
    target_backoff_s: float = Field(
        0.5, gt=0, description="A failed target replica is skipped this long; doubles per failure in a row."
    )
    target_max_backoff_s: float = Field(10.0, gt=0, description="Cap of the target replicas' back-off.")
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="Who shares the workers' prefix caches: 'tenant' (the default), only sessions of the same "
        "authenticated client (its bearer token, or its client certificate's names; without client "
        "authentication every client is one anonymous tenant) with the same cache_salt / prompt_cache_key, so "
        "no client can learn from cached_tokens or timing what another's prompts hold; 'shared', every "
        "session with the same cache_salt / prompt_cache_key whoever sent it (one tenant, or tenants who trust "
        "each other: more hits, and each can probe the others' prompts) (docs/operations.md, 'Who shares "
        "the prefix cache').",
    )
    route_prefix_tokens: int = Field(
        64,
        ge=0,
        description="A session goes to the target and draft replicas its prompt's first this-many tokens hash to "
        "(where an earlier turn of the conversation left its prefix cache); 0: by session id "
        "(docs/design.md, 'Routing by prefix').",
    )
    route_load_factor: float = Field(
        1.25,
        ge=1.0,
        description="Bounded load: a replica this coordinator already gives more than this times its fair "
        "share of sessions, plus route_load_slack, is passed over for the next one of the session's order.",
    )
    route_load_slack: int = Field(
        8,
        ge=0,
        description="Sessions a replica may hold beyond route_load_factor times its fair share before new "
        "sessions whose prefix hashes to it go to the next replica (a conversation stays where its cache is "
        "until the imbalance is this large).",
    )

    insecure: bool = Field(
        False,
        description="Listen on a non-loopback address with neither auth_tokens nor tls_ca_file (client "
        "certificates): anyone who reaches the port can generate. Off: such a coordinator refuses to start.",
    )

    @property
    def authenticates_clients(self) -> bool:
        """Client bearer tokens, or mutual TLS (client certificates from tls_ca_file), are configured."""
        return bool(self.auth_tokens) or self.tls_ca_file is not None

    @field_validator(
        "draft_endpoints", "target_endpoints", "auth_tokens", "trusted_proxies", "opt_in_sources", mode="before"
    )
    @classmethod
    def _split(cls, value: object) -> object:
        return _split_commas(value)

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _path_to_str(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    @model_validator(mode="after")
    def _limits(self) -> CoordinatorSettings:
        if not (is_loopback(self.host) or self.authenticates_clients or self.insecure):
            raise ValueError(
                f"this coordinator would listen on {self.host}, beyond this machine, without authenticating "
                "its clients: anyone reaching the port could generate on your models. Set auth_tokens "
                "(SPECSERVE_AUTH_TOKENS), or tls_ca_file (mutual TLS: client certificates required), or "
                "listen on 127.0.0.1; insecure=true (--insecure) accepts anyone"
            )
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies: {proxy!r} is not an IP address or network; list addresses or CIDR "
                    "networks such as 10.0.0.0/8"
                ) from None
        if self.trusted_proxies and not self.client_limits_by_address:
            raise ValueError(
                "trusted_proxies names whose X-Forwarded-For gives a caller's address for the per-client "
                "limits, which apply by address only with client_limits_by_address=true: set it too, or "
                "leave trusted_proxies empty"
            )
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must not exceed max_new_tokens_limit")
        for tier in ("draft", "target"):
            if getattr(self, f"{tier}_max_backoff_s") < getattr(self, f"{tier}_backoff_s"):
                raise ValueError(f"{tier}_max_backoff_s must be at least {tier}_backoff_s")
        features_call_bytes(self.features_per_call_bytes, self.max_message_bytes)
        return self

    @property
    def feature_bytes_per_call(self) -> int:
        """``features_per_call_bytes`` resolved (unset: a quarter of ``max_message_bytes``)."""
        return features_call_bytes(self.features_per_call_bytes, self.max_message_bytes)
