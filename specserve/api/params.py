"""Domain objects for what a request asks: :class:`GenerationParams` (the one definition of a request's
knobs), and the sampling settings and mode, stop conditions, proposer and log probabilities the servers
act on.

Pure Python (no torch): the coordinator, both workers and the SDK share them.
Each checks itself on construction and raises :class:`~specserve.api.errors.InvalidArgument`
saying what to fix; ``from_pb`` / ``to_pb`` convert at the wire boundary.
"""

from __future__ import annotations

import math
from argparse import BooleanOptionalAction
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument
from specserve.v1 import common_pb2, coordinator_pb2

#: The one proposer table: the SDK's name of each ``ProposerKind`` a draft can run.
PROPOSER_KINDS: dict[str, common_pb2.ProposerKind] = {
    "model": common_pb2.PROPOSER_KIND_MODEL,
    "ngram": common_pb2.PROPOSER_KIND_NGRAM,
    "feature": common_pb2.PROPOSER_KIND_FEATURE,
}
#: What an unspecified proposer means: the draft model.
DEFAULT_PROPOSER = common_pb2.PROPOSER_KIND_MODEL
#: A session's ``FinishReason`` while it continues.
NOT_FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
#: The ``FinishReason`` of each way a generation ends, by the SDK's name of it.
FINISH_REASONS: dict[str, common_pb2.FinishReason] = {
    "eos": common_pb2.FINISH_REASON_EOS,
    "stop_token": common_pb2.FINISH_REASON_STOP_TOKEN,
    "stop_string": common_pb2.FINISH_REASON_STOP_STRING,
    "length": common_pb2.FINISH_REASON_LENGTH,
}

#: The smallest non-zero temperature. Below it ``logits / temperature`` overflows
#: float32 for ordinary logits and the probabilities become NaN (vLLM's floor is the same).
MIN_TEMPERATURE = 0.01
#: The range of ``repetition_penalty``: outside it a penalised logit can overflow (or
#: underflow every logit to -inf), which leaves no distribution to sample from.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
#: The longest session id (characters) any service accepts.
MAX_SESSION_ID_CHARS = 128
#: The longest cache salt (characters) a request may send (``GenerateRequest.cache_salt``).
MAX_CACHE_SALT_CHARS = 1024
#: The longest prefix-cache scope (bytes) a worker accepts (``VerifyItem.cache_scope``: a hash).
MAX_CACHE_SCOPE_BYTES = 64


def resolve_proposer(kind: int, default: int = DEFAULT_PROPOSER) -> int:
    """The ``ProposerKind`` a wire value asks for (UNSPECIFIED: ``default``, the server's choice).

    Raises :class:`InvalidArgument` for a value no proposer has.
    """
    if kind == common_pb2.PROPOSER_KIND_UNSPECIFIED:
        return default
    if kind not in PROPOSER_KINDS.values():
        known = ", ".join(common_pb2.ProposerKind.Name(k) for k in PROPOSER_KINDS.values())
        raise InvalidArgument(f"unknown proposer {kind}; use one of {known} (or leave it unspecified)")
    return kind


#: The one sampling-mode table: the SDK's name of each ``SamplingMode`` (docs/design.md, "Two sampling modes").
SAMPLING_MODES: dict[str, common_pb2.SamplingMode] = {
    "optimal": common_pb2.SAMPLING_MODE_OPTIMAL,
    "coupled": common_pb2.SAMPLING_MODE_COUPLED,
}
#: What an unspecified sampling mode means: the optimal rule (the most accepted tokens per round).
DEFAULT_SAMPLING_MODE = "optimal"


def resolve_sampling_mode(mode: int) -> str:
    """The sampling mode's name for a wire ``SamplingMode`` (UNSPECIFIED: :data:`DEFAULT_SAMPLING_MODE`).

    Raises :class:`InvalidArgument` for a value no mode has.
    """
    if mode == common_pb2.SAMPLING_MODE_UNSPECIFIED:
        return DEFAULT_SAMPLING_MODE
    for name, value in SAMPLING_MODES.items():
        if value == mode:
            return name
    known = ", ".join(common_pb2.SamplingMode.Name(v) for v in SAMPLING_MODES.values())
    raise InvalidArgument(f"unknown sampling_mode {mode}; use one of {known} (or leave it unspecified)")


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing and sampling settings, with Hugging Face ``generate()`` semantics.

    ``temperature == 0`` is greedy decoding: only the repetition penalty applies,
    then argmax (as ``do_sample=False``); top-k, top-p and min-p are ignored.
    ``sampling_mode`` (a key of :data:`SAMPLING_MODES`) is how a sampled token is
    decided when a draft proposed it: ``"optimal"`` (rejection sampling) or
    ``"coupled"`` (Gumbel-max with shared noise: the output does not depend on
    the draft); greedy decoding is the same in both. ``constraint``: structured output
    (:class:`~specserve.api.constraints.Constraint`), masked before any other processing
    (docs/design.md, "Constrained decoding"); None: unconstrained.

    The bounds (:data:`MIN_TEMPERATURE`, :data:`REPETITION_PENALTY_RANGE`) keep
    the processed logits finite, so no setting can turn a distribution into NaN.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    sampling_mode: str = DEFAULT_SAMPLING_MODE
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidArgument(
                f"temperature={self.temperature:g} is too small: use 0 (greedy) or at least "
                f"{MIN_TEMPERATURE:g} (smaller values overflow the logits)"
            )
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidArgument(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 disables it), "
                f"got {self.repetition_penalty:g}"
            )
        if not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}")
        if self.sampling_mode not in SAMPLING_MODES:
            raise InvalidArgument(
                f"sampling_mode must be one of {sorted(SAMPLING_MODES)}, got {self.sampling_mode!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing processing the logits: the token is their argmax."""
        return self.greedy and self.repetition_penalty == 1.0

    @property
    def coupled(self) -> bool:
        """Sampled with the coupled rule (False for greedy decoding, which needs no noise)."""
        return self.sampling_mode == "coupled" and not self.greedy

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams, *, default_seed: int = 0) -> SamplingParams:
        return cls(
            temperature=pb.temperature,
            top_k=pb.top_k,
            top_p=pb.top_p if pb.HasField("top_p") else 1.0,
            min_p=pb.min_p,
            repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
            seed=pb.seed if pb.HasField("seed") else default_seed,
            sampling_mode=resolve_sampling_mode(pb.sampling_mode),
            constraint=Constraint.from_pb(pb.constraint) if pb.HasField("constraint") else None,
        )

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """From ``dataclasses.asdict`` of one (the JSON form the store records)."""
        constraint = data.get("constraint")
        return cls(**{**data, "constraint": Constraint.from_dict(constraint) if constraint else None})

    def to_pb(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            sampling_mode=SAMPLING_MODES[self.sampling_mode],
            constraint=self.constraint.to_pb() if self.constraint is not None else None,
        )


@dataclass(frozen=True)
class StopConditions:
    """When a generation ends. Nothing after a stop is ever committed.

    ``min_new_tokens`` (vLLM's ``min_tokens``): until that many tokens are generated the stop
    tokens (:meth:`stop_tokens`) are masked out of the distribution, in the target and the draft
    alike (:func:`specserve.core.sampling.suppress_tokens`), so the generation cannot end before
    then except at ``max_new_tokens`` or the context. Stop strings are not combined with it (a stop
    string completed before ``min_new_tokens`` would have to be ignored, and a later match found
    past it; the stop-string matching does not do that).
    """

    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidArgument(
                f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.min_new_tokens and self.stop_strings:
            raise InvalidArgument(
                "min_new_tokens cannot be combined with stop strings: a stop string completed before "
                "min_new_tokens would have to be skipped, which this server's stop-string matching does not "
                "do; send stop_token_ids, or no min_new_tokens"
            )
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
            min_new_tokens=pb.min_new_tokens,
        )

    def to_pb(self) -> common_pb2.StopConditions:
        return common_pb2.StopConditions(
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            stop_strings=list(self.stop_strings),
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_new_tokens,
        )

    def stop_tokens(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end the generation: ``stop_token_ids``, and ``eos_token_ids`` unless ``ignore_eos``."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_token_ids)

    def masked_rows(self, generated: int, rows: int) -> int:
        """How many of ``rows`` consecutive positions, the first after ``generated`` generated tokens, have
        their stop tokens masked (``min_new_tokens`` not reached before the token they emit)."""
        return max(0, min(rows, self.min_new_tokens - generated))


@dataclass(frozen=True)
class SessionBase:
    """A session's committed prefix as the sender knows it."""

    session_id: str
    committed_len: int
    version: int

    def __post_init__(self) -> None:
        if not self.session_id:
            raise InvalidArgument("session_id must not be empty")
        if len(self.session_id) > MAX_SESSION_ID_CHARS:
            raise InvalidArgument(
                f"session_id has {len(self.session_id)} characters; at most {MAX_SESSION_ID_CHARS} are accepted"
            )

    @classmethod
    def from_pb(cls, pb: common_pb2.SessionBase) -> SessionBase:
        return cls(session_id=pb.session_id, committed_len=pb.committed_len, version=pb.version)

    def to_pb(self) -> common_pb2.SessionBase:
        return common_pb2.SessionBase(
            session_id=self.session_id, committed_len=self.committed_len, version=self.version
        )


#: The most alternatives a request may ask for at each position (``top_logprobs``), as OpenAI's API.
MAX_TOP_LOGPROBS = 20


def check_top_logprobs(top_logprobs: int) -> int:
    """``top_logprobs`` if it is in ``[0, MAX_TOP_LOGPROBS]``; InvalidArgument otherwise."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    return top_logprobs


def check_cache_scope(scope: bytes) -> bytes:
    """A worker's check of a session's prefix-cache scope (at most :data:`MAX_CACHE_SCOPE_BYTES`)."""
    if len(scope) > MAX_CACHE_SCOPE_BYTES:
        raise InvalidArgument(
            f"cache_scope has {len(scope)} bytes; at most {MAX_CACHE_SCOPE_BYTES} are accepted (send a hash)"
        )
    return bytes(scope)


def check_min_confidence(min_confidence: float) -> float:
    """``min_confidence`` (dynamic draft length) if it is in ``[0, 1)``; InvalidArgument otherwise (NaN too)."""
    if not 0.0 <= min_confidence < 1.0:  # NaN fails both comparisons
        raise InvalidArgument(
            f"min_confidence={min_confidence} must be in [0, 1): the draft stops after a token it drafted "
            "with probability below it (0: draft the whole gamma)"
        )
    return float(min_confidence)


@dataclass(frozen=True)
class TokenLogprob:
    """A token and the natural log of its probability (see ``TokenLogprob`` in common.proto)."""

    token_id: int
    logprob: float

    @classmethod
    def from_pb(cls, pb: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(token_id=pb.token_id, logprob=pb.logprob)

    def to_pb(self) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=self.token_id, logprob=self.logprob)


@dataclass(frozen=True)
class PositionLogprobs:
    """Log probabilities at one emitted position, from the target's processed distribution there.

    ``token_id`` is the emitted token and ``logprob`` its log probability;
    ``top_logprobs`` the most likely tokens, most likely first (see
    ``PositionLogprobs`` in common.proto for what "processed" means for greedy
    requests).
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_pb(cls, pb: common_pb2.PositionLogprobs) -> PositionLogprobs:
        return cls(
            token_id=pb.token_id,
            logprob=pb.logprob,
            top_logprobs=tuple(TokenLogprob.from_pb(t) for t in pb.top_logprobs),
        )

    def to_pb(self) -> common_pb2.PositionLogprobs:
        return common_pb2.PositionLogprobs(
            token_id=self.token_id, logprob=self.logprob, top_logprobs=[t.to_pb() for t in self.top_logprobs]
        )

    @classmethod
    def from_dict(cls, data: dict) -> PositionLogprobs:
        """From ``dataclasses.asdict`` of one (the JSON form the store records)."""
        return cls(
            token_id=int(data["token_id"]),
            logprob=float(data["logprob"]),
            top_logprobs=tuple(TokenLogprob(int(t["token_id"]), float(t["logprob"])) for t in data["top_logprobs"]),
        )


@dataclass(frozen=True)
class Verdict:
    """The committed outcome of one verify round (see ``Verdict`` in common.proto).

    ``logprobs``: one entry per committed token when the round asked for them, else empty.
    """

    accepted_count: int
    committed_token_ids: tuple[int, ...]
    bonus: bool
    new_version: int
    committed_len: int
    finish_reason: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED
    logprobs: tuple[PositionLogprobs, ...] = ()

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
            logprobs=tuple(PositionLogprobs.from_pb(p) for p in pb.logprobs),
        )

    def to_pb(self) -> common_pb2.Verdict:
        return common_pb2.Verdict(
            accepted_count=self.accepted_count,
            committed_token_ids=list(self.committed_token_ids),
            bonus=self.bonus,
            new_version=self.new_version,
            committed_len=self.committed_len,
            finish_reason=self.finish_reason,
            logprobs=[p.to_pb() for p in self.logprobs],
        )


# --------------------------------------------------------------------------- one request's knobs


def _check_uint(name: str, value: object, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
        raise InvalidArgument(f"{name} must be an integer in [0, 2**{bits}), got {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number, got {value!r}")


def _knob(default: Any, help: str, **cli: Any) -> Any:
    """A :class:`GenerationParams` field: ``help`` documents it (the SDK, ``specserve generate --help``);
    ``cli`` holds its ``argparse`` options (``flag`` renames it, ``cli=None`` keeps it off the command line)."""
    return field(default=default, metadata={"help": help, "cli": cli.get("cli", cli)})


@dataclass(frozen=True)
class GenerationParams:
    """A request's sampling, stop and speculation settings: the one definition (issue 44).

    The SDK's ``generate`` / ``stream`` / ``chat`` take these fields as keyword arguments
    (their signatures are generated from this class), ``specserve generate`` as flags,
    the HTTP API maps its body onto them (specserve/coordinator/openai_protocol.py), and the
    coordinator reads them from the wire with :meth:`from_pb`. Construction checks
    every value that needs no server limit and raises
    :class:`~specserve.api.errors.InvalidArgument` naming it; the server's limits
    (``max_new_tokens``, ``gamma``, the vocabulary) are checked by the coordinator
    (specserve/coordinator/requests.py). ``None`` leaves a setting to the server.

    Sampling follows Hugging Face ``generate()``: ``temperature`` 0 is greedy; ``top_k`` 0,
    ``top_p`` 1, ``min_p`` 0 and ``repetition_penalty`` 1 disable those. ``sampling_mode``
    decides what a seed fixes: both modes sample exactly from the target; with ``"optimal"``
    the text for a seed also depends on the draft's proposals (it repeats only under the same
    fixed ``gamma``, ``proposer`` and draft), with ``"coupled"`` (Gumbel-max with shared noise)
    the same seed gives the same text whatever the gamma, proposer, draft, batch or failover,
    at some cost in accepted draft tokens (docs/design.md, "Two sampling modes").

    ``logprobs=True``: each token's log probability under the target's processed
    distribution (the request's own logits processing; for greedy requests the repetition
    penalty then a softmax at temperature 1) and the ``top_logprobs`` (0..20) most likely
    alternatives. ``prediction`` (Predicted Outputs): text or token ids the completion is
    expected to largely repeat; the server drafts from it and verifies every drafted token,
    so the output is unchanged, only the speed. ``hybrid_lookup`` and ``min_confidence``
    change the speed only, never the output (docs/design.md). ``cache_salt`` scopes the
    prefix cache the request may use and fill (docs/design.md, "The prefix cache"): speed only.
    """

    max_new_tokens: int | None = _knob(None, "most tokens to generate (None: the server's default)", type=int)
    temperature: float = _knob(1.0, "softmax temperature; 0 is greedy", type=float)
    top_k: int = _knob(0, "keep the k most likely tokens (0: off)", type=int)
    top_p: float = _knob(1.0, "nucleus sampling mass in (0, 1] (1: off)", type=float)
    min_p: float = _knob(0.0, "drop tokens below min_p times the most likely one's probability (0: off)", type=float)
    repetition_penalty: float = _knob(1.0, "CTRL repetition penalty in [0.01, 100] (1: off)", type=float)
    seed: int | None = _knob(None, "seed of a sampled completion (None: the server picks one, reported in the stats)", type=int)
    stop: str | Sequence[str] = _knob((), "stop strings (included in the completion)", action="append")
    stop_token_ids: Sequence[int] = _knob(
        (), "token ids that end the completion", flag="--stop-token-id", type=int, action="append"
    )
    ignore_eos: bool = _knob(False, "keep generating past the end-of-sequence token", action="store_true")
    min_new_tokens: int = _knob(
        0, "fewest tokens to generate: until then EOS and stop_token_ids are masked (not with stop strings)", type=int
    )
    gamma: int | Literal["auto"] | None = _knob(
        None, "draft tokens per round, or 'auto' (None: the server's policy)", metavar="N|auto"
    )
    proposer: Literal["model", "feature", "ngram"] | None = _knob(
        None,
        "feature: the feature head; model: the token draft; ngram: prompt lookup (None: the server's default)",
        choices=sorted(PROPOSER_KINDS),
    )
    draft_top_k: int = _knob(0, "the draft truncates its distribution to k tokens (0: off; exactness kept)", type=int)
    sampling_mode: Literal["optimal", "coupled"] | None = _knob(
        None,
        "optimal: rejection sampling, most tokens accepted; coupled: a seed gives the same text whatever the "
        "gamma, proposer or draft (None: the server's default, optimal)",
        choices=sorted(SAMPLING_MODES),
    )
    logprobs: bool = _knob(False, "report each token's log probability", cli=None)
    top_logprobs: int = _knob(0, "alternatives listed per token with logprobs, 0..20", cli=None)
    prediction: str | Sequence[int] | None = _knob(
        None, "Predicted Outputs: text or token ids the completion is expected to repeat", cli=None
    )
    hybrid_lookup: bool | None = _knob(
        None,
        "with gamma auto and the model proposer, also draft copied text from a prompt lookup "
        "(None: the server's setting, on)",
        action=BooleanOptionalAction,
    )
    min_confidence: float | None = _knob(
        None,
        "dynamic draft length: the draft ends a proposal after a token it drafted with probability below "
        "this, in [0, 1) (None: the server's setting with gamma auto, 0 with a fixed gamma)",
        type=float,
    )
    keep_special_tokens: bool = _knob(
        False, "the text keeps the special tokens (EOS, chat markers)", action="store_true"
    )
    cache_salt: str | None = _knob(
        None,
        "salts the prefix cache: the request shares cached prompt prefixes only with this client's requests "
        f"of the same salt (vLLM's cache_salt; 1..{MAX_CACHE_SALT_CHARS} characters; None: the client's "
        "unsalted scope)",
        type=str,
    )
    constraint: Constraint | None = _knob(  # noqa: RUF009 (a field(), as every knob)
        None,
        "structured output: the completion matches this JSON schema, regex, choice or grammar "
        "(docs/design.md, \"Constrained decoding\"); on the command line KIND:VALUE: json_schema:{...} or "
        "json_schema:@FILE, regex:RE, choice:[\"a\", \"b\"], grammar:GBNF or grammar:@FILE, json_object",
        metavar="KIND:VALUE",
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the convenient forms once, here
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgument(f"stop must be a string or a list of strings, got {self.stop!r}")
        set_(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise InvalidArgument(f"stop_token_ids must be a list of token ids, got {ids!r}")
        for tok in ids:
            _check_uint("stop_token_ids", tok, 32)
        set_(self, "stop_token_ids", tuple(ids))
        if self.gamma == "auto":
            set_(self, "gamma", None)
        if self.gamma is not None and (isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 0):
            raise InvalidArgument(f"gamma must be 'auto' (or None) or an integer >= 0, got {self.gamma!r}")
        if self.gamma is not None:
            _check_uint("gamma", self.gamma, 32)
        if self.prediction is not None and not isinstance(self.prediction, str):
            if isinstance(self.prediction, bytes) or not isinstance(self.prediction, Sequence):
                raise InvalidArgument(
                    f"prediction must be text (str) or token ids, got {type(self.prediction).__name__}"
                )
            for predicted in self.prediction:
                _check_uint("prediction token ids", predicted, 32)
            set_(self, "prediction", tuple(self.prediction))
        for name in ("top_k", "draft_top_k", "min_new_tokens", "top_logprobs"):
            _check_uint(name, getattr(self, name), 32)
        if self.max_new_tokens is not None:
            _check_uint("max_new_tokens", self.max_new_tokens, 32)
        if self.seed is not None:
            _check_uint("seed", self.seed, 64)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _check_number(name, getattr(self, name))
        if self.proposer is not None and self.proposer not in PROPOSER_KINDS:
            raise InvalidArgument(f"proposer must be one of {sorted(PROPOSER_KINDS)} (or None), got {self.proposer!r}")
        if self.sampling_mode is not None and self.sampling_mode not in SAMPLING_MODES:
            raise InvalidArgument(
                f"sampling_mode must be one of {sorted(SAMPLING_MODES)} (or None), got {self.sampling_mode!r}"
            )
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidArgument(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
        if self.constraint is not None and self.min_new_tokens:
            raise InvalidArgument(
                "min_new_tokens cannot be combined with a constraint: where the grammar is complete before "
                "min_new_tokens, end-of-sequence is the only token it allows and min_new_tokens forbids it"
            )
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str):
                raise InvalidArgument(f"cache_salt must be a string (or None), got {type(self.cache_salt).__name__}")
            if not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
                raise InvalidArgument(
                    f"cache_salt has {len(self.cache_salt)} characters; send 1 to {MAX_CACHE_SALT_CHARS} "
                    "(or leave it out)"
                )
        if self.min_confidence is not None:
            _check_number("min_confidence", self.min_confidence)
            check_min_confidence(self.min_confidence)
        check_top_logprobs(self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs=True")
        self.sampling_params(default_seed=0)  # SamplingParams' and StopConditions' own checks
        self.stop_conditions(default_max_new_tokens=max(1, self.min_new_tokens))

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments of the SDK's methods (``client.generate(prompt, **p.as_kwargs())``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- what the servers act on --------------------------------------------------------
    def sampling_params(self, *, default_seed: int) -> SamplingParams:
        """The sampling settings, ``default_seed`` where the request sets none."""
        return SamplingParams(
            temperature=float(self.temperature),
            top_k=self.top_k,
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            seed=default_seed if self.seed is None else self.seed,
            sampling_mode=self.sampling_mode or DEFAULT_SAMPLING_MODE,
            constraint=self.constraint,
        )

    def stop_conditions(self, *, default_max_new_tokens: int) -> StopConditions:
        """The stop conditions, ``default_max_new_tokens`` where the request sets none."""
        return StopConditions(
            max_new_tokens=self.max_new_tokens or default_max_new_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            stop_strings=tuple(self.stop),
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_new_tokens,
        )

    # ---- the wire -----------------------------------------------------------------------
    def to_pb(self) -> coordinator_pb2.GenerateRequest:
        """A ``GenerateRequest`` with these settings and no prompt (the caller sets it)."""
        request = coordinator_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=None if self.top_p == 1.0 else self.top_p,  # absent: off
                min_p=self.min_p,
                repetition_penalty=None if self.repetition_penalty == 1.0 else self.repetition_penalty,
                seed=self.seed,
                sampling_mode=SAMPLING_MODES[self.sampling_mode]
                if self.sampling_mode is not None
                else common_pb2.SAMPLING_MODE_UNSPECIFIED,
            ),
            stop=common_pb2.StopConditions(
                max_new_tokens=self.max_new_tokens or 0,
                stop_token_ids=list(self.stop_token_ids),
                stop_strings=list(self.stop),
                ignore_eos=self.ignore_eos,
                min_new_tokens=self.min_new_tokens,
            ),
            speculation=coordinator_pb2.SpeculationParams(
                gamma=self.gamma if isinstance(self.gamma, int) else None,  # "auto" was made None
                proposer=PROPOSER_KINDS[self.proposer]
                if self.proposer is not None
                else common_pb2.PROPOSER_KIND_UNSPECIFIED,
                draft_top_k=self.draft_top_k,
                hybrid_lookup=self.hybrid_lookup,
                min_confidence=self.min_confidence,
            ),
            keep_special_tokens=self.keep_special_tokens,
            cache_salt=self.cache_salt or "",
        )
        if self.constraint is not None:
            request.sampling.constraint.CopyFrom(self.constraint.to_pb())
        if self.logprobs:
            request.logprobs.top_logprobs = self.top_logprobs
            request.logprobs.SetInParent()
        if isinstance(self.prediction, str):
            request.prediction.text = self.prediction
        elif self.prediction is not None:
            request.prediction.tokens.token_ids.extend(self.prediction)
            request.prediction.tokens.SetInParent()
        return request

    def as_sent(self) -> GenerationParams:
        """These settings as a ``GenerateRequest`` carries them, checked again: what a server acts on, whichever
        front end read them (the wire's floats have 32 bits; the HTTP API reads its bodies through this, so
        that a setting means the same over HTTP as over gRPC)."""
        return GenerationParams.from_pb(self.to_pb())

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.GenerateRequest) -> GenerationParams:
        """The settings of a ``GenerateRequest``, checked; absent fields are None (the server's choice)."""
        sampling, stop, spec = pb.sampling, pb.stop, pb.speculation
        proposer = None
        if spec.proposer != common_pb2.PROPOSER_KIND_UNSPECIFIED:
            kind = resolve_proposer(spec.proposer)
            proposer = next(name for name, value in PROPOSER_KINDS.items() if value == kind)
        prediction: str | tuple[int, ...] | None = None
        if pb.HasField("prediction"):
            which = pb.prediction.WhichOneof("content")
            prediction = pb.prediction.text if which == "text" else tuple(pb.prediction.tokens.token_ids)
        return cls(
            max_new_tokens=stop.max_new_tokens or None,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
            seed=sampling.seed if sampling.HasField("seed") else None,
            stop=tuple(stop.stop_strings),
            stop_token_ids=tuple(stop.stop_token_ids),
            ignore_eos=stop.ignore_eos,
            min_new_tokens=stop.min_new_tokens,
            gamma=spec.gamma if spec.HasField("gamma") else None,
            proposer=proposer,  # type: ignore[arg-type]
            draft_top_k=spec.draft_top_k,
            sampling_mode=None
            if sampling.sampling_mode == common_pb2.SAMPLING_MODE_UNSPECIFIED
            else resolve_sampling_mode(sampling.sampling_mode),  # type: ignore[arg-type]
            logprobs=pb.HasField("logprobs"),
            top_logprobs=pb.logprobs.top_logprobs,
            prediction=prediction,
            hybrid_lookup=spec.hybrid_lookup if spec.HasField("hybrid_lookup") else None,
            min_confidence=spec.min_confidence if spec.HasField("min_confidence") else None,
            keep_special_tokens=pb.keep_special_tokens,
            cache_salt=pb.cache_salt or None,
            constraint=Constraint.from_pb(sampling.constraint) if sampling.HasField("constraint") else None,
        )
