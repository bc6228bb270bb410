"""One kernel path per kind of machine, measured once and shared by every replica of that kind.

Which linear kernels run a model fastest depends on the CPU: PyTorch's stock kernels won on one
kind of machine this project ran on, the packed oneDNN ones on another (docs/benchmarks/kernels.md).
A fixed default is wrong somewhere, and a choice timed in each process can differ between two
replicas of the same deployment, which then compute different bits. So a worker whose ``kernels``
setting is ``auto`` looks up the choice for its :class:`HardwareKind` and model shape in the
deployment's Redis (:func:`shared_choice`): the first replica of a kind to start times both paths and
records the winner (``SET NX``); every later replica of that kind, and a replica that lost the race to
record, runs what was recorded. docs/design.md ("Kernels per kind of machine") says how a new kind is
handled and how to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis
import structlog
import torch

log = structlog.get_logger(__name__)

#: The CPU flags that decide which kernels exist and how fast they run (vector widths, bfloat16 and int8
#: dot products, AMX tiles); the rest of a CPU's flags do not move a matmul.
KERNEL_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2",
)
#: Redis key prefix of the recorded choices: ``specserve:kernels:v1:<digest of the kind and model>``.
KEY_PREFIX = "specserve:kernels:v1:"
_UNREACHABLE = (redis.RedisError, OSError)
#: The paths a record may name.
PATHS = ("stock", "onednn")


@dataclass(frozen=True)
class HardwareKind:
    """What a kernel choice is valid for: the CPU model and its kernel-relevant flags, the torch build, the
    model thread's thread count, and the model's shape and dtype (weights' values do not matter)."""

    cpu: str
    flags: tuple[str, ...]
    torch: str
    threads: int
    model: str  # the model's shape: architecture and sizes
    dtype: str
    role: str  # "target" (a verify pass) or "draft" (a drafting step): what was timed

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]
        return KEY_PREFIX + digest

    def describe(self) -> str:
        return f"{self.cpu} [{' '.join(self.flags) or 'no vector flags'}], torch {self.torch}, {self.threads} threads"


def cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    """This machine's CPU model name and its :data:`KERNEL_FLAGS` (Linux: /proc/cpuinfo; elsewhere what
    :mod:`platform` says, with no flags)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if field == "model name":
                    name = value.strip()
                elif field in ("flags", "Features"):
                    flags = set(value.split())
                if field == "" and flags:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return name, tuple(f for f in KERNEL_FLAGS if f in flags)


def model_shape(model: Any) -> str:
    """The shape fields of ``model``'s config that decide its matmuls and attention."""
    config = model.config.get_text_config(decoder=True)
    fields = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    return json.dumps({f: getattr(config, f, None) for f in fields}, sort_keys=True)


def hardware_kind(model: Any, role: str) -> HardwareKind:
    """The :class:`HardwareKind` of ``model`` (on the CPU) as this process runs it."""
    cpu, flags = cpu_model_and_flags()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return HardwareKind(cpu, flags, torch.__version__, torch.get_num_threads(), model_shape(model), dtype, role)


@dataclass(frozen=True)
class Choice:
    """A recorded kernel path: what won, each path's timing (ms, the sum of medians timed), who measured."""

    kernels: str
    timings_ms: dict[str, float]
    measured_by: str
    measured_at: float
    shared: bool  # read from (or recorded in) the deployment's Redis; False: timed here alone
    kind: str = ""  # HardwareKind.describe() of the kind it was measured for
    role: str = ""  # what was timed: "target" or "draft"

    def to_json(self) -> str:
        return json.dumps({"kernels": self.kernels, "timings_ms": self.timings_ms, "measured_by": self.measured_by,
                           "measured_at": self.measured_at, "kind": self.kind, "role": self.role})

    @classmethod
    def from_json(cls, raw: str | bytes, *, shared: bool = True) -> Choice:
        data = json.loads(raw)
        return cls(str(data["kernels"]), dict(data.get("timings_ms", {})), str(data.get("measured_by", "")),
                   float(data.get("measured_at", 0.0)), shared, str(data.get("kind", "")), str(data.get("role", "")))


Measure = Callable[[], tuple[str, dict[str, float]]]


def shared_choice(redis_url: str | None, kind: HardwareKind, measure: Measure) -> Choice:
    """The kernel path for ``kind``: the one recorded in the Redis at ``redis_url``, or, where none is,
    ``measure()``'s (``(path, {path: ms})``), recorded for every later replica of the kind. Two replicas that
    measure at once both end on the first record. Without a Redis (``None``, or one that cannot be
    reached) the path is measured here alone, and the log says so."""
    client = _client(redis_url)
    try:
        held = _get(client, kind.key())
        if held is not None:
            log.info("kernels_shared", kernels=held.kernels, measured_by=held.measured_by, kind=kind.describe(),
                     role=kind.role, key=kind.key())
            return held
        path, timings = measure()
        mine = Choice(path, {p: round(ms, 3) for p, ms in timings.items()},
                      f"{socket.gethostname()}:{os.getpid()}", time.time(), False, kind.describe(), kind.role)
        recorded = _record(client, kind.key(), mine)
        if recorded is None:
            log.warning("kernels_timed_alone", kernels=path, kind=kind.describe(), role=kind.role, **_ms(timings))
            return mine
        log.info("kernels_recorded", kernels=recorded.kernels, kind=kind.describe(), role=kind.role,
                 key=kind.key(), **_ms(timings))
        return recorded
    finally:
        if client is not None:
            client.close()


def _get(client: Any, key: str) -> Choice | None:
    if client is None:
        return None
    try:
        held = client.get(key)
    except _UNREACHABLE as exc:  # measure here, as without a Redis
        log.warning("kernels_store_unreachable", error=str(exc))
        return None
    if held is None:
        return None
    try:
        choice = Choice.from_json(held)
    except (ValueError, KeyError, TypeError):
        choice = None
    if choice is None or choice.kernels not in PATHS:
        log.warning("kernels_record_invalid", key=key, record=str(held)[:200])
        client.delete(key)
        return None
    return choice


def _record(client: Any, key: str, mine: Choice) -> Choice | None:
    """Record ``mine`` unless a choice is held already; the choice every replica of the kind runs (None:
    no Redis to record in)."""
    if client is None:
        return None
    try:
        if client.set(key, mine.to_json(), nx=True):
            return Choice.from_json(mine.to_json())
        held = client.get(key)  # another replica recorded first: run its choice
        return Choice.from_json(held) if held is not None else None
    except _UNREACHABLE as exc:
        log.warning("kernels_store_unreachable", error=str(exc))
        return None


def recorded(redis_url: str) -> list[Choice]:
    """Every choice recorded in the Redis at ``redis_url`` (what the deployment's replicas run)."""
    client = _client(redis_url)
    if client is None:
        return []
    try:
        return [Choice.from_json(client.get(key)) for key in client.scan_iter(match=KEY_PREFIX + "*")]
    finally:
        client.close()


def forget(redis_url: str, kind: HardwareKind | None = None) -> int:
    """Delete the recorded choice of ``kind`` (None: of every kind) so that the next replica to start
    measures again; returns how many were deleted."""
    client = _client(redis_url)
    if client is None:
        raise ConnectionError(f"no Redis at {redis_url}")
    try:
        keys = [kind.key()] if kind is not None else list(client.scan_iter(match=KEY_PREFIX + "*"))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def _ms(timings: dict[str, float]) -> dict[str, float]:
    return {f"{p}_ms": round(ms, 2) for p, ms in timings.items()}


def _client(redis_url: str | None) -> Any:
    if not redis_url:
        return None
    return redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
