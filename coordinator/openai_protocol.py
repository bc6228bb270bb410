"""The OpenAI API's wire shapes: request bodies in, ``GenerateRequest`` messages out, reply bodies back.

Pure data (pydantic and dicts); no HTTP, no sessions. :mod:`coordinator.http_api`
parses a body into :class:`CompletionRequest` or :class:`ChatCompletionRequest`,
refuses what is not supported (:meth:`~_OpenAIRequest.check_supported`),
converts it to one :class:`~specserve.v1.coordinator_pb2.GenerateRequest` per
choice (:meth:`~_OpenAIRequest.to_pb`) and hands those to the same
``Coordinator.parse`` / ``Coordinator.generate`` as the gRPC servicer. The
reply bodies are built by :mod:`coordinator.openai_replies`.

Request fields, and where each goes:

=============================  ==============================================================
``temperature`` (default 1)    ``SamplingParams.temperature`` (0 is greedy)
``top_p``                      ``SamplingParams.top_p``
``max_tokens`` /               ``StopConditions.max_new_tokens`` (completions default to 16 as
``max_completion_tokens``      OpenAI's do; chat defaults to the server's ``default_max_new_tokens``)
``stop`` (str or list)         ``StopConditions.stop_strings``; as OpenAI does, the stop string
                               is not part of the returned text
``seed``                       ``SamplingParams.seed``; choice ``i`` of ``n`` uses ``seed + i``
``n``                          ``n`` independent sessions
extension ``top_k``,           ``SamplingParams`` (``top_k`` -1 or 0 disables it, as in vLLM)
``min_p``,
``repetition_penalty``
extension ``ignore_eos``,      ``StopConditions``
``stop_token_ids``
extension ``speculation``      ``SpeculationParams``: ``{"gamma": int | "auto", "proposer":
                               "model" | "ngram", "draft_top_k": int,
                               "hybrid_lookup": bool, "min_confidence": float}``
chat ``logprobs`` (bool),      ``GenerateRequest.logprobs`` (``top_logprobs`` 0..20; it needs
``top_logprobs``               ``logprobs: true``)
completions ``logprobs`` (int) ``GenerateRequest.logprobs`` with that many alternatives, 0..20
``prediction``                 ``GenerateRequest.prediction``: ``{"type": "content", "content":
                               str | [text parts]}`` (Predicted Outputs; on completions too)
=============================  ==============================================================

Refused with 400 (:meth:`check_supported`): non-zero ``frequency_penalty`` /
``presence_penalty`` (the verifier would have to apply them exactly;
``repetition_penalty`` is);
``logit_bias``, tools, ``response_format`` other than text, ``echo``,
``suffix``, ``best_of`` other than ``n``, several prompts in one completion
request, and non-text message parts. Any field the API does not define is
refused as OpenAI does ("Unrecognized request argument supplied"); ``user``,
``metadata``, ``store``, ``service_tier``, ``safety_identifier``,
``prompt_cache_key`` and ``parallel_tool_calls`` are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specserve.api.errors import InvalidArgument
from specserve.api.params import MAX_TOP_LOGPROBS
from specserve.v1 import common_pb2, coordinator_pb2

#: ``max_tokens`` of a completion request that sets none (OpenAI's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_UINT64 = 2**64

_PROPOSERS = {"model": common_pb2.PROPOSER_KIND_MODEL, "ngram": common_pb2.PROPOSER_KIND_NGRAM}


def bad_param(param: str | None, message: str, code: str = "invalid_value") -> InvalidArgument:
    """An :class:`InvalidArgument` that names the offending request field (OpenAI's ``param``)."""
    exc = InvalidArgument(message)
    exc.param = param  # type: ignore[attr-defined]
    exc.openai_code = code  # type: ignore[attr-defined]
    return exc


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SpeculationOptions(BaseModel):
    """Extension: how the session speculates (absent: the server's automatic policy)."""

    model_config = ConfigDict(extra="forbid")

    gamma: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    proposer: Literal["model", "ngram"] = "model"
    draft_top_k: int = Field(0, ge=0)
    hybrid_lookup: bool | None = None
    min_confidence: float | None = Field(None, ge=0.0, lt=1.0)


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
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
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
    prompt_cache_key: str | None = None
    # Extensions (vLLM's names where vLLM has them).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = None
    speculation: SpeculationOptions | None = None
    prediction: PredictionIn | None = None

    # ---- checks -------------------------------------------------------------------------
    def check_supported(self) -> None:
        """Refuse (400, naming the field) what this server does not do yet."""
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "stream_options is only allowed with stream: true")
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

    # ---- to the wire --------------------------------------------------------------------
    def max_new_tokens(self) -> int:
        """0 means the server's default."""
        return self.max_tokens or 0

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token when the request asks for logprobs; None when it does not."""
        return None

    def prompt_pb(self, pb: coordinator_pb2.GenerateRequest) -> None:
        raise NotImplementedError

    def to_pb(self, choice: int = 0) -> coordinator_pb2.GenerateRequest:
        """The ``GenerateRequest`` of choice ``choice`` (its seed is ``seed + choice``)."""
        sampling = common_pb2.SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
        )
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.repetition_penalty is not None:
            sampling.repetition_penalty = self.repetition_penalty
        if self.seed is not None:
            sampling.seed = (self.seed + choice) % _UINT64
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        spec = self.speculation or SpeculationOptions()
        speculation = coordinator_pb2.SpeculationParams(
            proposer=_PROPOSERS[spec.proposer],
            draft_top_k=spec.draft_top_k,
            hybrid_lookup=spec.hybrid_lookup,
            min_confidence=spec.min_confidence,
        )
        if isinstance(spec.gamma, int):
            speculation.gamma = spec.gamma
        pb = coordinator_pb2.GenerateRequest(
            sampling=sampling,
            stop=common_pb2.StopConditions(
                max_new_tokens=self.max_new_tokens(),
                stop_token_ids=list(self.stop_token_ids or ()),
                stop_strings=stops,
                ignore_eos=self.ignore_eos,
            ),
            speculation=speculation,
        )
        top = self.top_logprobs_wanted()
        if top is not None:
            pb.logprobs.top_logprobs = top
            pb.logprobs.SetInParent()
        if self.prediction is not None:
            pb.prediction.text = _text_parts(self.prediction.content, "prediction.content")
        self.prompt_pb(pb)
        return pb

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

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

    def prompt_pb(self, pb: coordinator_pb2.GenerateRequest) -> None:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            pb.text = prompt
            return
        bad = [t for t in prompt if not 0 <= t < 2**32]
        if bad:
            raise bad_param("prompt", f"prompt token id {bad[0]} is not a token id")
        pb.tokens.token_ids.extend(prompt)
        pb.tokens.SetInParent()


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # accepted and ignored (there are no tools)
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise bad_param("tools", "tools and function calling are not supported", "unsupported_parameter")
        if self.function_call not in (None, "none"):
            raise bad_param("function_call", "function calling is not supported", "unsupported_parameter")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_param(
                "response_format", "only response_format {'type': 'text'} is supported", "unsupported_value"
            )
        for i, message in enumerate(self.messages):
            message.text(i)  # refuses non-text parts

    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_pb(self, pb: coordinator_pb2.GenerateRequest) -> None:
        pb.chat.messages.extend(
            coordinator_pb2.ChatMessage(role=m.role, content=m.text(i)) for i, m in enumerate(self.messages)
        )
        pb.chat.SetInParent()


def parse_body(cls: type[_OpenAIRequest], body: Any) -> _OpenAIRequest:
    """Validate a JSON body; errors become 400s naming the field, as OpenAI words them."""
    if not isinstance(body, dict):
        raise bad_param(None, "the request body must be a JSON object", "invalid_request")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


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
