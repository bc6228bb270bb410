"""Domain objects for what a request asks: sampling settings and stop conditions.

Pure Python (no torch): the coordinator, both workers and the SDK share them.
Each checks itself on construction and raises :class:`~specserve.errors.InvalidArgument`
saying what to fix; ``from_pb`` / ``to_pb`` convert at the wire boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.errors import InvalidArgument
from specserve.v1 import common_pb2


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing and sampling settings, with Hugging Face ``generate()`` semantics.

    ``temperature == 0`` is greedy decoding: only the repetition penalty applies,
    then argmax (as ``do_sample=False``); top-k, top-p and min-p are ignored.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidArgument(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        if not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams, *, default_seed: int = 0) -> SamplingParams:
        return cls(
            temperature=pb.temperature,
            top_k=pb.top_k,
            top_p=pb.top_p if pb.HasField("top_p") else 1.0,
            min_p=pb.min_p,
            repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
            seed=pb.seed if pb.HasField("seed") else default_seed,
        )

    def to_pb(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
        )


@dataclass(frozen=True)
class StopConditions:
    """When a generation ends. Nothing after a stop is ever committed."""

    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids must be non-negative token ids")
        if any(s == "" for s in self.stop_strings):
            raise InvalidArgument("stop_strings must not contain the empty string")

    @classmethod
    def from_pb(cls, pb: common_pb2.StopConditions, *, default_max_new_tokens: int) -> StopConditions:
        return cls(
            max_new_tokens=pb.max_new_tokens or default_max_new_tokens,
            stop_token_ids=tuple(pb.stop_token_ids),
            stop_strings=tuple(pb.stop_strings),
            ignore_eos=pb.ignore_eos,
        )

    def to_pb(self) -> common_pb2.StopConditions:
        return common_pb2.StopConditions(
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            stop_strings=list(self.stop_strings),
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True)
class SessionBase:
    """A session's committed prefix as the sender knows it."""

    session_id: str
    committed_len: int
    version: int

    def __post_init__(self) -> None:
        if not self.session_id:
            raise InvalidArgument("session_id must not be empty")

    @classmethod
    def from_pb(cls, pb: common_pb2.SessionBase) -> SessionBase:
        return cls(session_id=pb.session_id, committed_len=pb.committed_len, version=pb.version)

    def to_pb(self) -> common_pb2.SessionBase:
        return common_pb2.SessionBase(
            session_id=self.session_id, committed_len=self.committed_len, version=self.version
        )


@dataclass(frozen=True)
class Verdict:
    """The committed outcome of one verify round (see ``Verdict`` in common.proto)."""

    accepted_count: int
    committed_token_ids: tuple[int, ...]
    bonus: bool
    new_version: int
    committed_len: int
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    @classmethod
    def from_pb(cls, pb: common_pb2.Verdict) -> Verdict:
        return cls(
            accepted_count=pb.accepted_count,
            committed_token_ids=tuple(pb.committed_token_ids),
            bonus=pb.bonus,
            new_version=pb.new_version,
            committed_len=pb.committed_len,
            finish_reason=pb.finish_reason,
        )

    def to_pb(self) -> common_pb2.Verdict:
        return common_pb2.Verdict(
            accepted_count=self.accepted_count,
            committed_token_ids=list(self.committed_token_ids),
            bonus=self.bonus,
            new_version=self.new_version,
            committed_len=self.committed_len,
            finish_reason=self.finish_reason,
        )
