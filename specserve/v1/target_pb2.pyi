from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyItem(_message.Message):
    __slots__ = ("base", "proposal", "logprobs", "decode_steps", "features_from", "features_from_uncached", "features_max_bytes", "cache_scope")
    BASE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_UNCACHED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    base: _common_pb2.SessionBase
    proposal: _common_pb2.Proposal
    logprobs: _common_pb2.LogprobsParams
    decode_steps: int
    features_from: int
    features_from_uncached: bool
    features_max_bytes: int
    cache_scope: bytes
    def __init__(self, base: _Optional[_Union[_common_pb2.SessionBase, _Mapping]] = ..., proposal: _Optional[_Union[_common_pb2.Proposal, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobsParams, _Mapping]] = ..., decode_steps: _Optional[int] = ..., features_from: _Optional[int] = ..., features_from_uncached: _Optional[bool] = ..., features_max_bytes: _Optional[int] = ..., cache_scope: _Optional[bytes] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("session_id", "verdict", "error", "replayed", "features", "cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    verdict: _common_pb2.Verdict
    error: ItemError
    replayed: bool
    features: _common_pb2.Features
    cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., replayed: _Optional[bool] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "verify_ns", "forward_ns", "positions_processed")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    verify_ns: int
    forward_ns: int
    positions_processed: int
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., verify_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., positions_processed: _Optional[int] = ...) -> None: ...

class ReleaseTargetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseTargetSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTargetInfoResponse(_message.Message):
    __slots__ = ("model", "max_gamma", "max_batch_size", "verify_curve_ns", "feature")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CURVE_NS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    max_gamma: int
    max_batch_size: int
    verify_curve_ns: _containers.RepeatedScalarFieldContainer[int]
    feature: str
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., max_gamma: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., verify_curve_ns: _Optional[_Iterable[int]] = ..., feature: _Optional[str] = ...) -> None: ...
