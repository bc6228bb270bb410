from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("base", "start_position", "token_ids", "sampling", "gamma", "proposer", "draft_top_k", "seed", "stop_token_ids", "ignore_eos", "min_confidence", "features", "features_reset", "stop_tokens_from", "prompt_len", "cache_scope", "tree_max_nodes", "tree_min_path_probability", "tree_expand_min_path_probability")
    BASE_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_RESET_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FROM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    TREE_MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_MIN_PATH_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    TREE_EXPAND_MIN_PATH_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    base: _common_pb2.SessionBase
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    gamma: int
    proposer: _common_pb2.ProposerKind
    draft_top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_confidence: float
    features: _common_pb2.Features
    features_reset: bool
    stop_tokens_from: int
    prompt_len: int
    cache_scope: bytes
    tree_max_nodes: int
    tree_min_path_probability: float
    tree_expand_min_path_probability: float
    def __init__(self, base: _Optional[_Union[_common_pb2.SessionBase, _Mapping]] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., gamma: _Optional[int] = ..., proposer: _Optional[_Union[_common_pb2.ProposerKind, str]] = ..., draft_top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_confidence: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., features_reset: _Optional[bool] = ..., stop_tokens_from: _Optional[int] = ..., prompt_len: _Optional[int] = ..., cache_scope: _Optional[bytes] = ..., tree_max_nodes: _Optional[int] = ..., tree_min_path_probability: _Optional[float] = ..., tree_expand_min_path_probability: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposal", "draft_ns", "prefill_tokens", "features_needed_from", "expansion_passes")
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_NEEDED_FROM_FIELD_NUMBER: _ClassVar[int]
    EXPANSION_PASSES_FIELD_NUMBER: _ClassVar[int]
    proposal: _common_pb2.Proposal
    draft_ns: int
    prefill_tokens: int
    features_needed_from: int
    expansion_passes: int
    def __init__(self, proposal: _Optional[_Union[_common_pb2.Proposal, _Mapping]] = ..., draft_ns: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., features_needed_from: _Optional[int] = ..., expansion_passes: _Optional[int] = ...) -> None: ...

class ProposeBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class ProposeError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ProposeBatchResult(_message.Message):
    __slots__ = ("proposal", "error")
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    proposal: ProposeResponse
    error: ProposeError
    def __init__(self, proposal: _Optional[_Union[ProposeResponse, _Mapping]] = ..., error: _Optional[_Union[ProposeError, _Mapping]] = ...) -> None: ...

class ProposeBatchResponse(_message.Message):
    __slots__ = ("results", "draft_ns")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeBatchResult]
    draft_ns: int
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeBatchResult, _Mapping]]] = ..., draft_ns: _Optional[int] = ...) -> None: ...

class ReleaseDraftSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseDraftSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDraftInfoResponse(_message.Message):
    __slots__ = ("model", "max_gamma", "max_batch_size", "proposers", "feature")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    max_gamma: int
    max_batch_size: int
    proposers: _containers.RepeatedScalarFieldContainer[_common_pb2.ProposerKind]
    feature: str
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., max_gamma: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., proposers: _Optional[_Iterable[_Union[_common_pb2.ProposerKind, str]]] = ..., feature: _Optional[str] = ...) -> None: ...
