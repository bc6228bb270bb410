"""The OpenAI API's wire shapes: request bodies in, the coordinator's request (settings and prompt) out.

Pure data (pydantic and dicts); no HTTP, no sessions. A body parses into :class:`CompletionRequest` or
:class:`ChatCompletionRequest` (:func:`parse_body`: an unknown field refused, or dropped under
``http_unknown_fields: ignore``), refuses what this server cannot honour exactly with a 400 naming the field
(:meth:`~_OpenAIRequest.check_supported`; every number range-checked), and meets the SDK's knobs in one
:class:`~specserve.api.params.GenerationParams` (:meth:`~_OpenAIRequest.params`), which with the prompt makes
one request per choice (:meth:`~_OpenAIRequest.generation`, choice ``i`` seeded ``seed + i``); what only
shapes the reply is :class:`ReplyOptions`. Every field and what becomes of it is the table in
docs/operations.md ("Request fields"), which tests/specserve/coordinator/test_field_table.py checks against
:meth:`~_OpenAIRequest.effect`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specserve.api.errors import InvalidArgument
from specserve.api.params import (
    MAX_CACHE_SALT_CHARS,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    GenerationParams,
)
from specserve.coordinator.chat import RESERVED_TEMPLATE_NAMES, Conversation
from specserve.coordinator.requests import Prompt, random_seed
from specserve.coordinator.structured_outputs import (
    CONSTRAINT_FIELDS,
    StructuredOutput,
    ToolCallShape,
    structured_output,
)

log = structlog.get_logger(__name__)

#: ``max_tokens`` of a completion request that sets none (OpenAI's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_UINT64 = 2**64
_UINT32 = 2**32
#: The longest ``cache_salt`` or ``prompt_cache_key``: both fit one ``GenerateRequest.cache_salt`` together.
MAX_HTTP_CACHE_KEY_CHARS = (MAX_CACHE_SALT_CHARS - 1) // 2
#: The largest finite float32, the wire's type of the sampling settings.
_FLOAT32_MAX = 3.4028234663852886e38

def bad_param(param: str | None, message: str, code: str = "invalid_value") -> InvalidArgument:
    """An :class:`InvalidArgument` that names the offending request field (OpenAI's ``param``)."""
    exc = InvalidArgument(message)
    exc.param = param  # type: ignore[attr-defined]
    exc.openai_code = code  # type: ignore[attr-defined]
    return exc


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the request's usage; ``continuous_usage_stats`` (vLLM's
    extension, with ``include_usage``): every chunk carries the usage so far."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class ReplyOptions:
    """What a request asks of its reply's shape, beside its sessions (the reply builder's settings)."""

    include_usage: bool = False  # a usage chunk at the end of a stream
    continuous_usage: bool = False  # usage (so far) in every chunk of a stream
    trim_stop_strings: tuple[str, ...] = ()  # stop strings cut off the returned text
    logprobs: bool = False  # render each token's logprobs
    tool_call: ToolCallShape | None = None  # the text is one forced tool call (chat)


#: Fields besides ``CONSTRAINT_FIELDS`` that structured output reads.
_STRUCTURED_EXTRAS = ("guided_decoding_backend", "guided_whitespace_pattern", "tools", "tool_choice")

#: vLLM's extension fields this server does not implement: accepted at vLLM's default (the first
#: value, or None), refused with the reason otherwise. Shared by both endpoints.
_UNSUPPORTED_COMMON: dict[str, tuple[Any, str]] = {
    "spaces_between_special_tokens": (True, "special tokens are decoded as the tokenizer decodes them"),
    "use_beam_search": (False, "beam search is not implemented"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not implemented"),
    "truncate_prompt_tokens": (None, "prompts are never truncated: shorten the prompt"),
    "prompt_logprobs": (None, "prompt logprobs are not computed (logprobs covers the completion)"),
    "allowed_token_ids": (None, "a token allow-list is not implemented"),
    "bad_words": ([], "bad_words is not implemented"),
    "logits_processors": (None, "custom logits processors are not implemented"),
    "return_tokens_as_token_ids": (False, "logprobs show each token's text"),
    "return_token_ids": (False, "token ids are not returned over HTTP (the gRPC API returns them)"),
    "priority": (0, "requests are not scheduled by priority"),
    "kv_transfer_params": (None, "KV transfer is not implemented"),
    "vllm_xargs": (None, "vllm_xargs is not implemented"),
}


class SpeculationOptions(BaseModel):
    """Extension: how the session speculates (absent: the server's automatic policy)."""

    model_config = ConfigDict(extra="forbid")

    gamma: Annotated[int, Field(ge=0, lt=_UINT32)] | Literal["auto"] | None = None
    proposer: Literal["model", "feature", "ngram"] | None = None  # None: the server's default
    draft_top_k: int = Field(0, ge=0, lt=_UINT32)
    hybrid_lookup: bool | None = None
    min_confidence: float | None = Field(None, ge=0.0, lt=1.0)
    sampling_mode: Literal["optimal", "coupled"] | None = None  # None: the server's default (optimal)


def _text_parts(content: str | list[dict[str, Any]], param: str) -> str:
    """``content`` as one string: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_param(param, f"only text content parts are supported, got a part of type {kind!r}", "unsupported_value")
        parts.append(part["text"])
    return "".join(parts)


class PredictionIn(BaseModel):
    """Predicted Outputs: ``{"type": "content", "content": str | [text parts]}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[dict[str, Any]]


class ChatMessageIn(BaseModel):
    """One message of ``messages``: ``content`` a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted and not used (few chat templates read it)

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        return _text_parts(self.content, f"messages[{index}].content")


class _OpenAIRequest(BaseModel):
    """What both endpoints accept."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=_FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, lt=_UINT32)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=_UINT64)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    # Honoured: each scopes the prefix cache within the client's own (specserve/coordinator/cache_scope.py).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_HTTP_CACHE_KEY_CHARS)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_HTTP_CACHE_KEY_CHARS)  # vLLM's
    request_id: str | None = None  # vLLM's own request id; the log's is the x-request-id header
    # Extensions (vLLM's names where vLLM has them).
    top_k: int | None = Field(None, ge=-1, lt=_UINT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=_UINT32)]] | None = None
    min_tokens: int = Field(0, ge=0, lt=_UINT32)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculation: SpeculationOptions | None = None
    prediction: PredictionIn | None = None
    # vLLM's extensions not implemented (_UNSUPPORTED_COMMON): accepted at their defaults.
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    # Structured output (specserve/coordinator/structured_outputs.py): vLLM's names.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    priority: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    #: The endpoint's own unimplemented extensions (same form as ``_UNSUPPORTED_COMMON``).
    _unsupported: ClassVar[dict[str, tuple[Any, str]]] = {}

    # ---- checks -------------------------------------------------------------------------
    @classmethod
    def unsupported_fields(cls) -> dict[str, tuple[Any, str]]:
        """The fields refused unless absent, null or at their default: name -> (default, why)."""
        return {**_UNSUPPORTED_COMMON, **cls._unsupported}

    #: The endpoint reads ``tools`` and ``tool_choice`` (chat).
    _tools: ClassVar[bool] = False

    def structured(self) -> StructuredOutput:
        """The constraint of the output and the reply's shape (specserve/coordinator/structured_outputs.py); a 400
        naming the field for a mistake."""
        fields = {name: getattr(self, name, None) for name in (*CONSTRAINT_FIELDS, *_STRUCTURED_EXTRAS)}
        return structured_output(fields, tools_allowed=self._tools)

    def check_supported(self) -> None:
        """Refuse (400, naming the field) what this server does not do yet."""
        for name, (default, why) in self.unsupported_fields().items():
            value = getattr(self, name)
            if value is not None and value != default:
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                instead = "leave it out" if default is None else f"send {json.dumps(default)} or leave it out"
                raise bad_param(
                    name, f"{name}={shown} is not supported: {why} ({instead})", "unsupported_parameter"
                )
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "stream_options is only allowed with stream: true")
        if self.min_tokens:
            if self.stop_strings:
                raise bad_param(
                    "min_tokens",
                    "min_tokens cannot be combined with stop strings: a stop string completed before "
                    "min_tokens would have to be skipped, which this server's stop-string matching does not "
                    "do; use stop_token_ids, or leave min_tokens out",
                    "unsupported_value",
                )
            wanted = self.max_new_tokens()
            if wanted and self.min_tokens > wanted:
                raise bad_param("min_tokens", f"min_tokens={self.min_tokens} is above max_tokens={wanted}")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise bad_param(
                    name,
                    f"{name} is not supported: the verifier applies every logits processor exactly and "
                    "does not implement this one; send 0, or use the repetition_penalty extension field",
                    "unsupported_parameter",
                )
        if self.logit_bias:
            raise bad_param("logit_bias", "logit_bias is not supported", "unsupported_parameter")
        if self.prediction is not None:
            _text_parts(self.prediction.content, "prediction.content")  # refuses non-text parts
        self.structured()  # refuses a constraint it cannot read

    # ---- to the wire --------------------------------------------------------------------
    def max_new_tokens(self) -> int:
        """0 means the server's default."""
        return self.max_tokens or 0

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token when the request asks for logprobs; None when it does not."""
        return None

    def to_prompt(self) -> Prompt:
        raise NotImplementedError

    def params(self, choice: int = 0) -> GenerationParams:
        """The :class:`GenerationParams` of choice ``choice`` (its seed is ``seed + choice``): where each of
        its fields comes from in the body. A value they refuse is a 400 naming the field."""
        spec = self.speculation or SpeculationOptions()
        top = self.top_logprobs_wanted()
        return GenerationParams(
            max_new_tokens=self.max_new_tokens() or None,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=None if self.seed is None else (self.seed + choice) % _UINT64,
            stop=self.stop_strings,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_tokens,
            gamma=spec.gamma,
            proposer=spec.proposer,
            draft_top_k=spec.draft_top_k,
            sampling_mode=spec.sampling_mode,
            logprobs=top is not None,
            top_logprobs=top or 0,
            prediction=None
            if self.prediction is None
            else _text_parts(self.prediction.content, "prediction.content"),
            hybrid_lookup=spec.hybrid_lookup,
            min_confidence=spec.min_confidence,
            keep_special_tokens=not self.skip_special_tokens,
            cache_salt=self.salt(),
            constraint=self.structured().constraint,
        )

    def salt(self) -> str | None:
        """The request's cache salt (``GenerateRequest.cache_salt``): ``cache_salt`` and ``prompt_cache_key``
        (OpenAI's) together, each a scope of its own within the client's; None when neither is sent."""
        if self.prompt_cache_key is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00{self.prompt_cache_key}"

    def generation(self, choice: int = 0) -> tuple[GenerationParams, Prompt]:
        """What the coordinator checks of choice ``choice`` (its seed is ``seed + choice``): its settings as a
        ``GenerateRequest`` would carry them (:meth:`GenerationParams.as_sent`) and its prompt."""
        return self.params(choice).as_sent(), self.to_prompt()

    def reply_options(self) -> ReplyOptions:
        """How the reply is shaped (:class:`ReplyOptions`)."""
        usage = bool(self.stream and self.stream_options and self.stream_options.include_usage)
        return ReplyOptions(
            include_usage=usage,
            continuous_usage=usage and bool(self.stream_options and self.stream_options.continuous_usage_stats),
            trim_stop_strings=() if self.include_stop_str_in_output else self.stop_strings,
            logprobs=self.top_logprobs_wanted() is not None,
            tool_call=self.structured().tool,
        )

    def effect(self) -> tuple[Any, ...]:
        """Everything the HTTP layer reads from the request: the model it names, whether it streams,
        each choice's request (:meth:`generation`) and the reply's options. Two bodies with the same effect
        are served alike (the field table's test compares them)."""
        requests = tuple(self.generation(i) for i in range(self.n))
        return (self.model, self.stream, requests, self.reply_options())

    def choice_seed(self, choice: int) -> int:
        """The seed of choice ``choice``: ``seed + choice``, or a fresh one when the request sets none."""
        return random_seed() if self.seed is None else (self.seed + choice) % _UINT64

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: Any = None
    response_format: Any = None

    _unsupported: ClassVar[dict[str, tuple[Any, str]]] = {
        "add_special_tokens": (False, "text prompts are tokenized without special tokens"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_param("echo", "echo is not supported", "unsupported_parameter")
        if self.suffix:
            raise bad_param("suffix", "suffix is not supported", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_param("best_of", "best_of other than n is not supported", "unsupported_parameter")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise bad_param(
                "prompt",
                f"one prompt per request is supported, got {len(prompt)}: send them as separate requests",
                "unsupported_value",
            )

    def max_new_tokens(self) -> int:
        return self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def to_prompt(self) -> Prompt:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return Prompt(text=prompt)
        bad = [t for t in prompt if not 0 <= t < 2**32]
        if bad:
            raise bad_param("prompt", f"prompt token id {bad[0]} is not a token id")
        return Prompt(token_ids=tuple(prompt))


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    _tools: ClassVar[bool] = True

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = Field(None, ge=1, lt=_UINT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # accepted and ignored: a forced tool call is one call per choice
    response_format: dict[str, Any] | None = None
    # vLLM's chat extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extensions not implemented: accepted at their defaults.
    echo: Any = None
    add_special_tokens: Any = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None

    _unsupported: ClassVar[dict[str, tuple[Any, str]]] = {
        "echo": (False, "the reply does not repeat the prompt"),
        "add_special_tokens": (False, "the chat template places the special tokens"),
        "chat_template": (None, "the model's own chat template is always used"),
        "documents": (None, "the chat template is rendered without documents"),
        "mm_processor_kwargs": (None, "only text is supported"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        reserved = sorted(RESERVED_TEMPLATE_NAMES & set(self.chat_template_kwargs or {}))
        if reserved:
            raise bad_param(
                "chat_template_kwargs",
                f"{reserved[0]!r} is an argument of the chat template's rendering, not a template variable: "
                "leave it out of chat_template_kwargs (add_generation_prompt and continue_final_message are "
                "fields of their own)",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_param(
                "continue_final_message",
                "continue_final_message continues the final message, so the assistant's turn cannot also be "
                "opened: send add_generation_prompt: false with it",
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
        if self.functions:
            raise bad_param(
                "functions", "functions (the deprecated form) is not supported: send tools", "unsupported_parameter"
            )
        if self.function_call not in (None, "none"):
            raise bad_param(
                "function_call", "function_call (the deprecated form) is not supported: send tool_choice",
                "unsupported_parameter",
            )  # fmt: skip
        for i, message in enumerate(self.messages):
            message.text(i)  # refuses non-text parts

    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_prompt(self) -> Prompt:
        return Prompt(
            chat=Conversation(
                messages=tuple((m.role, m.text(i)) for i, m in enumerate(self.messages)),
                omit_generation_prompt=not self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                template_kwargs_json=json.dumps(self.chat_template_kwargs, sort_keys=True)
                if self.chat_template_kwargs
                else "",
            )
        )


def check_prompt_size(body: Any, *, max_tokens: int, max_bytes: int) -> None:
    """Refuse (400 naming the field) a token-list ``prompt`` longer than ``max_tokens`` and ``messages``
    larger than ``max_bytes`` (their roles and text contents, in UTF-8), on the parsed JSON, before
    validation builds anything from them."""
    if not isinstance(body, dict):
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        count = len(prompt[0]) if isinstance(prompt[0], list) else len(prompt)
        if count > max_tokens:
            raise bad_param(
                "prompt",
                f"the prompt has {count} tokens, more than this server's limit of {max_tokens}; shorten it",
                "context_length_exceeded",
            )
    messages = body.get("messages")
    if isinstance(messages, list):
        size = 0
        for message in messages:
            if isinstance(message, dict):
                for key in ("role", "content"):
                    value = message.get(key)
                    size += len(value.encode("utf-8", "replace")) if isinstance(value, str) else 0
            if size > max_bytes:
                raise bad_param(
                    "messages",
                    f"the conversation ({len(messages)} messages) is more than this server's limit of "
                    f"{max_bytes} bytes; shorten it",
                    "context_length_exceeded",
                )


def parse_body(
    cls: type[_OpenAIRequest], body: Any, *, unknown_fields: Literal["refuse", "ignore"] = "refuse"
) -> _OpenAIRequest:
    """Validate a JSON body; errors become 400s naming the field, as OpenAI words them.

    ``unknown_fields="ignore"`` (the server's ``http_unknown_fields``): fields no endpoint knows are
    dropped, each named in one ``http_unknown_fields_ignored`` warning, and the rest validated.
    """
    if not isinstance(body, dict):
        raise bad_param(None, "the request body must be a JSON object", "invalid_request")
    try:
        return cls.model_validate(body, strict=True)  # JSON types as the schema says: 0.0 is not a bool
    except ValidationError as exc:
        unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
        if unknown_fields == "ignore" and unknown:
            trimmed = copy.deepcopy(body)
            dropped = [path for path in unknown if _drop(trimmed, path)]
            if dropped:
                log.warning("http_unknown_fields_ignored", fields=[".".join(map(str, p)) for p in dropped])
                return parse_body(cls, trimmed, unknown_fields="refuse")
        raise validation_error(exc) from None


def _drop(body: Any, path: tuple[int | str, ...]) -> bool:
    """Remove the field at ``path`` (a pydantic error location) from ``body``; False if it is not there."""
    node = body
    for part in path[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return False
    if isinstance(node, dict) and path and path[-1] in node:
        del node[path[-1]]
        return True
    return False


#: Names pydantic puts in an error's location for the member of a union that failed.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple"}


def _is_field(part: object) -> bool:
    if isinstance(part, int):
        return True
    text = str(part)
    return text.isidentifier() and text not in _UNION_TAGS and not text[:1].isupper()


def validation_error(exc: ValidationError) -> InvalidArgument:
    """The first problem pydantic found, as a 400 naming the field (``messages.0.content``)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if _is_field(p)]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        if len(loc) == 1:
            return bad_param(param, f"Unrecognized request argument supplied: {param}", "unknown_parameter")
        return bad_param(param, f"unsupported field {param}", "unknown_parameter")
    if first["type"] == "missing":
        return bad_param(param, f"missing required parameter: {param}", "missing_required_parameter")
    return bad_param(param, f"invalid value for {param}: {first['msg']}", "invalid_value")
