"""Settings of each role, built once at start-up and passed down.

Each role has one settings class. Values come from keyword arguments (the CLI
flags), then from environment variables named ``SPECSERVE_<FIELD>`` in upper
case (``SPECSERVE_REDIS_URL``, ``SPECSERVE_TARGET_ENDPOINTS``; lists are
comma-separated), then the defaults below. Nothing is read at import time;
classes check themselves on construction and raise ``ValueError`` (pydantic's
``ValidationError``) saying what to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

CommaList = Annotated[list[str], NoDecode]


def _split_commas(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


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

    model: Path | None = Field(None, description="Local Hugging Face model directory; unset: the demo pair.")
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': bfloat16 on CUDA, float32 on CPU."
    )
    max_gamma: int = Field(16, ge=0, le=64, description="Largest number of draft tokens per round.")
    max_sessions: int = Field(256, ge=1, description="Sessions kept in the KV-cache store before LRU eviction.")
    kv_budget_bytes: int = Field(4 * 1024**3, ge=1, description="KV-cache memory budget before LRU eviction.")
    session_ttl_s: float = Field(600.0, gt=0, description="Idle sessions are released after this long.")
    warmup: bool = Field(True, description="Run one forward pass at start so the first request is not slow.")


class DraftSettings(WorkerSettings):
    """The draft service."""

    port: int = Field(50053, ge=0, le=65535)


class TargetSettings(WorkerSettings):
    """The target service."""

    port: int = Field(50052, ge=0, le=65535)
    max_batch_size: int = Field(32, ge=1, description="Most sessions in one Verify call.")


class CoordinatorSettings(CommonSettings):
    """The client-facing coordinator."""

    port: int = Field(50051, ge=0, le=65535)
    draft_endpoints: CommaList = Field(default_factory=list, description="host:port of each draft replica.")
    target_endpoints: CommaList = Field(
        default_factory=list, description="host:port of each target replica (sessions stick to one)."
    )
    tokenizer: Path | None = Field(None, description="Tokenizer directory (the target's); unset: the demo pair.")
    max_batch_size: int = Field(16, ge=1, description="Most sessions gathered into one Verify call.")
    max_batch_wait_ms: float = Field(2.0, ge=0, description="Longest a round waits for others to join its batch.")
    default_max_new_tokens: int = Field(256, ge=1)
    max_new_tokens_limit: int = Field(4096, ge=1, description="Requests asking for more are refused.")
    max_prompt_tokens: int = Field(8192, ge=1)
    max_sessions: int = Field(512, ge=1, description="Concurrent sessions in total.")
    max_sessions_per_client: int = Field(64, ge=1, description="Concurrent sessions per authenticated client.")
    max_gamma: int = Field(8, ge=0, le=64, description="Largest gamma the policy may pick.")
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of each call to a worker.")
    draft_timeout_s: float = Field(
        5.0, gt=0, description="Deadline of each Propose; a slower draft makes that round run at gamma 0."
    )
    auth_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Bearer tokens accepted from clients; empty disables auth."
    )
    worker_tls_ca_file: Path | None = Field(None, description="CA that signed the workers' certificates.")
    worker_tls_cert_file: Path | None = Field(None, description="Client certificate for mutual TLS to workers.")
    worker_tls_key_file: Path | None = Field(None, description="Key of worker_tls_cert_file.")

    @field_validator("draft_endpoints", "target_endpoints", "auth_tokens", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return _split_commas(value)

    @model_validator(mode="after")
    def _limits(self) -> CoordinatorSettings:
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must not exceed max_new_tokens_limit")
        return self
