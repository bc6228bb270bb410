from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLING_MODE_UNSPECIFIED: _ClassVar[SamplingMode]
    SAMPLING_MODE_OPTIMAL: _ClassVar[SamplingMode]
    SAMPLING_MODE_COUPLED: _ClassVar[SamplingMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class ProposerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_KIND_UNSPECIFIED: _ClassVar[ProposerKind]
    PROPOSER_KIND_MODEL: _ClassVar[ProposerKind]
    PROPOSER_KIND_NGRAM: _ClassVar[ProposerKind]
    PROPOSER_KIND_FEATURE: _ClassVar[ProposerKind]
SAMPLING_MODE_UNSPECIFIED: SamplingMode
SAMPLING_MODE_OPTIMAL: SamplingMode
SAMPLING_MODE_COUPLED: SamplingMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_LENGTH: FinishReason
PROPOSER_KIND_UNSPECIFIED: ProposerKind
PROPOSER_KIND_MODEL: ProposerKind
PROPOSER_KIND_NGRAM: ProposerKind
PROPOSER_KIND_FEATURE: ProposerKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "sampling_mode", "constraint")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MODE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int
    sampling_mode: SamplingMode
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., sampling_mode: _Optional[_Union[SamplingMode, str]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "stop_strings", "ignore_eos", "min_new_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    min_new_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start_position", "hidden_size", "float16_le")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLOAT16_LE_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    hidden_size: int
    float16_le: bytes
    def __init__(self, start_position: _Optional[int] = ..., hidden_size: _Optional[int] = ..., float16_le: _Optional[bytes] = ...) -> None: ...

class SessionBase(_message.Message):
    __slots__ = ("session_id", "committed_len", "version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_len: int
    version: int
    def __init__(self, session_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class DenseDistribution(_message.Message):
    __slots__ = ("probs_f32le",)
    PROBS_F32LE_FIELD_NUMBER: _ClassVar[int]
    probs_f32le: bytes
    def __init__(self, probs_f32le: _Optional[bytes] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("dense", "sparse")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    dense: DenseDistribution
    sparse: SparseDistribution
    def __init__(self, dense: _Optional[_Union[DenseDistribution, _Mapping]] = ..., sparse: _Optional[_Union[SparseDistribution, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("token_ids", "distributions", "parents")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted_count", "committed_token_ids", "bonus", "new_version", "committed_len", "finish_reason", "logprobs")
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted_count: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bonus: bool
    new_version: int
    committed_len: int
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, accepted_count: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., bonus: _Optional[bool] = ..., new_version: _Optional[int] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class LogprobsParams(_message.Message):
    __slots__ = ("top_logprobs",)
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    top_logprobs: int
    def __init__(self, top_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "vocab_fingerprint", "device", "dtype", "eos_token_id", "parameter_count", "max_positions")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    vocab_fingerprint: str
    device: str
    dtype: str
    eos_token_id: int
    parameter_count: int
    max_positions: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., eos_token_id: _Optional[int] = ..., parameter_count: _Optional[int] = ..., max_positions: _Optional[int] = ...) -> None: ...
