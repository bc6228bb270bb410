from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "omit_generation_prompt", "continue_final_message", "template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OMIT_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    omit_generation_prompt: bool
    continue_final_message: bool
    template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., omit_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., template_kwargs_json: _Optional[str] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("gamma", "proposer", "draft_top_k", "hybrid_lookup", "min_confidence")
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    HYBRID_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    gamma: int
    proposer: _common_pb2.ProposerKind
    draft_top_k: int
    hybrid_lookup: bool
    min_confidence: float
    def __init__(self, gamma: _Optional[int] = ..., proposer: _Optional[_Union[_common_pb2.ProposerKind, str]] = ..., draft_top_k: _Optional[int] = ..., hybrid_lookup: _Optional[bool] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "tokens", "chat", "sampling", "stop", "speculation", "logprobs", "prediction", "keep_special_tokens", "cache_salt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: PromptTokens
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    stop: _common_pb2.StopConditions
    speculation: SpeculationParams
    logprobs: _common_pb2.LogprobsParams
    prediction: Prediction
    keep_special_tokens: bool
    cache_salt: str
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[PromptTokens, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[_common_pb2.StopConditions, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobsParams, _Mapping]] = ..., prediction: _Optional[_Union[Prediction, _Mapping]] = ..., keep_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: PromptTokens
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[PromptTokens, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("session_id", "prompt_tokens", "completion_tokens", "rounds", "proposed_tokens", "accepted_tokens", "accepted_per_position", "draft_ns", "verify_ns", "queue_ns", "first_token_ns", "total_ns", "finish_reason", "seed", "draft_rounds", "accepted_prediction_tokens", "rejected_prediction_tokens", "target_ns", "forward_ns", "lookup_proposed_tokens", "lookup_accepted_tokens", "cached_tokens", "forced_proposed_tokens", "forced_accepted_tokens", "proposer", "sources")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    proposed_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    draft_ns: int
    verify_ns: int
    queue_ns: int
    first_token_ns: int
    total_ns: int
    finish_reason: _common_pb2.FinishReason
    seed: int
    draft_rounds: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    target_ns: int
    forward_ns: int
    lookup_proposed_tokens: int
    lookup_accepted_tokens: int
    cached_tokens: int
    forced_proposed_tokens: int
    forced_accepted_tokens: int
    proposer: _common_pb2.ProposerKind
    sources: _containers.RepeatedCompositeFieldContainer[SourceStats]
    def __init__(self, session_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., draft_ns: _Optional[int] = ..., verify_ns: _Optional[int] = ..., queue_ns: _Optional[int] = ..., first_token_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., seed: _Optional[int] = ..., draft_rounds: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ..., target_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., lookup_proposed_tokens: _Optional[int] = ..., lookup_accepted_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., forced_proposed_tokens: _Optional[int] = ..., forced_accepted_tokens: _Optional[int] = ..., proposer: _Optional[_Union[_common_pb2.ProposerKind, str]] = ..., sources: _Optional[_Iterable[_Union[SourceStats, _Mapping]]] = ...) -> None: ...

class SourceStats(_message.Message):
    __slots__ = ("name", "draft_rounds", "proposed_tokens", "accepted_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    draft_rounds: int
    proposed_tokens: int
    accepted_tokens: int
    def __init__(self, name: _Optional[str] = ..., draft_rounds: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "stats")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    stats: GenerationStats
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...
