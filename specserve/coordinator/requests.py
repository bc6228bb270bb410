"""A client's generation request as a checked domain object (``GenerationRequest.check``).

Every check raises :class:`~specserve.api.errors.InvalidArgument` with a message
that says what to fix; the server interceptor turns it into INVALID_ARGUMENT.
Limits come from :class:`~specserve.runtime.config.CoordinatorSettings` and the probed
worker limits (passed in, never read from the environment here).

Every limit holds before work is done, cheapest first: the sampling settings,
the stop conditions (count and length of ``stop_strings`` and
``stop_token_ids``), ``max_new_tokens`` and the speculation settings; then the
byte size of a text prompt or of a conversation's messages, *before* it is
tokenized or rendered with the chat template (the caller's ``tokenize`` and
``render_chat`` run off the event loop); then the prompt's length in tokens, and
the context: a prompt must leave room for one generated token in the smaller
context of the two models, and ``max_new_tokens`` is capped so that prompt +
generation fit (the generation then finishes with ``length`` at the context).
Any front end (gRPC, HTTP) reads its request into :class:`~specserve.api.params.GenerationParams` and a
:class:`Prompt` and calls this.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.api.errors import FailedPrecondition, InvalidArgument
from specserve.api.params import (
    DEFAULT_PROPOSER,
    PROPOSER_KINDS,
    GenerationParams,
    SamplingParams,
    StopConditions,
)
from specserve.coordinator.chat import ChatMessage, Conversation, TemplateOptions
from specserve.runtime.config import CoordinatorSettings

#: Tokenizes a text prompt (off the event loop) into token ids.
Tokenize = Callable[[str], Awaitable[tuple[int, ...]]]
#: Renders a conversation with the chat template and tokenizes it (off the event loop).
RenderChat = Callable[[list[ChatMessage], TemplateOptions], Awaitable[tuple[int, ...]]]


def random_seed() -> int:
    """A fresh 63-bit seed (fits signed 64-bit stores and JSON readers)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as sent, not yet checked: one of its text, its token ids or a conversation (None:
    not sent; all None: no prompt)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: Conversation | None = None


@dataclass(frozen=True)
class SpeculationSettings:
    """How a session speculates: ``gamma`` fixed, or None for the automatic policy."""

    gamma: int | None
    proposer: int  # a value of PROPOSER_KINDS (the wire's ProposerKind), never UNSPECIFIED
    draft_top_k: int = 0
    #: Keep a hybrid lookup beside the draft model (specserve/coordinator/speculation/sources/ngram.py); only where it applies:
    #: the automatic policy and the model proposer.
    hybrid_lookup: bool = False
    #: Dynamic draft length (specserve/draft/proposers.py): the draft ends a proposal after a token it drafted
    #: with probability below this; 0 for the n-gram proposer and, unless the request set it, a fixed gamma.
    min_confidence: float = 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate request: prompt tokens, sampling (seed fixed), stops, speculation.

    ``top_logprobs``: report each token's log probability with that many alternatives (None: no
    logprobs). ``prediction_token_ids``: Predicted Outputs, the prediction tokenized once (None: none).
    ``keep_special_tokens``: the text keeps the special tokens (else they decode to nothing).
    ``cache_salt``: salts the session's prefix-cache scope (specserve/coordinator/cache_scope.py; None: unsalted).
    """

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: StopConditions
    speculation: SpeculationSettings
    top_logprobs: int | None = None
    prediction_token_ids: tuple[int, ...] | None = None
    keep_special_tokens: bool = False  # the text keeps special tokens (vLLM's skip_special_tokens=False)
    cache_salt: str | None = None
    #: The constraint's compiled grammar (the engine's object), once the coordinator compiled it
    #: (``Coordinator.parse``); the session's forced-text proposer starts from it, so nothing compiles again.
    grammar: Any = field(default=None, compare=False, repr=False)

    def with_seed(self, seed: int) -> GenerationRequest:
        """This request with another seed (the HTTP API's choice ``i`` of ``n``: tokenized once)."""
        return replace(self, sampling=replace(self.sampling, seed=seed))

    @classmethod
    async def check(
        cls,
        params: GenerationParams,
        prompt: Prompt,
        *,
        settings: CoordinatorSettings,
        tokenize: Tokenize,
        render_chat: RenderChat,
        vocab_size: int,
        max_gamma: int,
        context_tokens: int | None = None,
        default_proposer: int = DEFAULT_PROPOSER,
        feature_head: bool = False,
    ) -> GenerationRequest:
        """Check ``params`` (already through every check that needs no server limit) and ``prompt`` against
        the server's limits, cheapest first; tokenize a text prompt last.

        ``default_proposer``: the proposer of a request that names none; ``feature_head``: whether the
        draft tier serves the feature head (a request for it is refused otherwise)."""
        if params.max_new_tokens is not None and params.max_new_tokens > settings.max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens={params.max_new_tokens} is above this server's limit of "
                f"{settings.max_new_tokens_limit}; ask for at most {settings.max_new_tokens_limit}"
            )
        _check_stop_lists(params, settings, vocab_size)
        sampling = params.sampling_params(default_seed=random_seed())
        stop = params.stop_conditions(default_max_new_tokens=settings.default_max_new_tokens)
        speculation = _speculation(
            params,
            max_gamma=max_gamma,
            vocab_size=vocab_size,
            hybrid_lookup=settings.hybrid_lookup,
            min_confidence=settings.draft_min_confidence,
            default_proposer=default_proposer,
            feature_head=feature_head,
        )
        top_logprobs = params.top_logprobs if params.logprobs else None
        prompt_ids = await _prompt(
            prompt, settings=settings, tokenize=tokenize, render_chat=render_chat, vocab_size=vocab_size
        )
        if len(prompt_ids) > settings.max_prompt_tokens:
            raise InvalidArgument(
                f"the prompt has {len(prompt_ids)} tokens, more than this server's limit of "
                f"{settings.max_prompt_tokens}; shorten it"
            )
        if context_tokens is not None:
            room = context_tokens - len(prompt_ids)
            if room < 1:
                raise InvalidArgument(
                    f"the prompt has {len(prompt_ids)} tokens but the model's context holds {context_tokens}, "
                    f"prompt and generation together; shorten the prompt to at most {context_tokens - 1} tokens"
                )
            if stop.max_new_tokens > room:  # generate up to the context, then finish with `length`
                stop = replace(stop, max_new_tokens=room, min_new_tokens=min(stop.min_new_tokens, room))
        prediction = await _prediction(params, settings=settings, tokenize=tokenize, vocab_size=vocab_size)
        return cls(
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            stop=stop,
            speculation=speculation,
            top_logprobs=top_logprobs,
            prediction_token_ids=prediction,
            keep_special_tokens=params.keep_special_tokens,
            cache_salt=params.cache_salt,
        )


async def _prediction(
    params: GenerationParams, *, settings: CoordinatorSettings, tokenize: Tokenize, vocab_size: int
) -> tuple[int, ...] | None:
    """The prediction's tokens (Predicted Outputs), tokenized once, off the event loop; None when the
    request has none. A prediction is held to the prompt's limits (``max_prompt_bytes`` before it is
    tokenized, ``max_prompt_tokens`` after); an empty one is no prediction.
    """
    if params.prediction is None:
        return None
    if isinstance(params.prediction, str):
        _check_bytes("the prediction", len(params.prediction.encode("utf-8")), settings)
        ids = tuple(await tokenize(params.prediction)) if params.prediction else ()
    else:
        ids = tuple(params.prediction)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidArgument(
                f"prediction token id {bad[0]} is outside the model's vocabulary of {vocab_size} tokens"
            )
    if len(ids) > settings.max_prompt_tokens:
        raise InvalidArgument(
            f"the prediction has {len(ids)} tokens, more than this server's limit of "
            f"{settings.max_prompt_tokens} (max_prompt_tokens); shorten it"
        )
    return ids or None


def _check_stop_lists(params: GenerationParams, settings: CoordinatorSettings, vocab_size: int) -> None:
    """Count and length of the stop lists against the server's limits."""
    if len(params.stop) > settings.max_stop_strings:
        raise InvalidArgument(
            f"{len(params.stop)} stop strings; this server accepts at most {settings.max_stop_strings}"
        )
    longest = max((len(s) for s in params.stop), default=0)
    if longest > settings.max_stop_string_chars:
        raise InvalidArgument(
            f"a stop string has {longest} characters; this server accepts at most "
            f"{settings.max_stop_string_chars} per stop string"
        )
    if len(params.stop_token_ids) > settings.max_stop_token_ids:
        raise InvalidArgument(
            f"{len(params.stop_token_ids)} stop token ids; this server accepts at most {settings.max_stop_token_ids}"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidArgument(f"stop token id {bad[0]} is outside the vocabulary of {vocab_size} tokens")


async def _prompt(
    prompt: Prompt,
    *,
    settings: CoordinatorSettings,
    tokenize: Tokenize,
    render_chat: RenderChat,
    vocab_size: int,
) -> tuple[int, ...]:
    if prompt.text is not None:
        if not prompt.text:
            raise InvalidArgument("the prompt is empty: send prompt text or prompt token ids")
        _check_bytes("the prompt text", len(prompt.text.encode("utf-8")), settings)
        ids = tuple(await tokenize(prompt.text))
        if not ids:
            raise InvalidArgument("the prompt text tokenizes to no tokens: send a non-empty prompt")
        return ids
    if prompt.token_ids is not None:
        ids = tuple(prompt.token_ids)
        if not ids:
            raise InvalidArgument("the prompt is empty: send at least one prompt token id")
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidArgument(
                f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab_size} tokens "
                f"(ids must be in [0, {vocab_size}))"
            )
        return ids
    if prompt.chat is not None:
        _check_bytes("the conversation", prompt.chat.size, settings)
        ids = tuple(await render_chat(list(prompt.chat.chat_messages()), TemplateOptions.of(prompt.chat)))
        if not ids:
            raise InvalidArgument("the conversation renders to no tokens: send a non-empty message")
        return ids
    raise InvalidArgument(
        "the prompt is empty: set GenerateRequest.text, GenerateRequest.tokens or GenerateRequest.chat"
    )


def _check_bytes(what: str, size: int, settings: CoordinatorSettings) -> None:
    if size > settings.max_prompt_bytes:
        raise InvalidArgument(
            f"{what} is {size} bytes, more than this server's limit of {settings.max_prompt_bytes} bytes; "
            "shorten it"
        )


def _speculation(
    params: GenerationParams,
    *,
    max_gamma: int,
    vocab_size: int,
    hybrid_lookup: bool = True,
    min_confidence: float = 0.0,
    default_proposer: int = DEFAULT_PROPOSER,
    feature_head: bool = False,
) -> SpeculationSettings:
    """The request's speculation against the server's limits and defaults (``hybrid_lookup``,
    ``min_confidence``: the server's settings for them under the automatic policy; ``default_proposer``,
    ``feature_head``: see ``GenerationRequest.check``)."""
    proposer = default_proposer if params.proposer is None else PROPOSER_KINDS[params.proposer]
    if proposer == PROPOSER_KINDS["feature"] and not feature_head:
        raise FailedPrecondition(
            "proposer 'feature' needs the feature head, and this server's draft replicas do not serve one "
            "(start them with --feature-head); use proposer 'model' or leave it unset"
        )
    gamma = params.gamma
    if gamma is not None and gamma > max_gamma:
        raise InvalidArgument(
            f"gamma={gamma} is above this server's maximum of {max_gamma}; "
            f"ask for 0..{max_gamma} or leave gamma unset for automatic"
        )
    if params.draft_top_k > vocab_size:
        raise InvalidArgument(
            f"draft_top_k={params.draft_top_k} exceeds the vocabulary size {vocab_size}; use 0 (off) or a smaller k"
        )
    lookup = hybrid_lookup if params.hybrid_lookup is None else params.hybrid_lookup
    model = proposer in (PROPOSER_KINDS["model"], PROPOSER_KINDS["feature"])  # a draft tier proposer
    if params.min_confidence is not None:
        confidence = params.min_confidence
    else:
        confidence = min_confidence if gamma is None else 0.0
    return SpeculationSettings(
        gamma=gamma,
        proposer=proposer,
        draft_top_k=params.draft_top_k,
        hybrid_lookup=lookup and gamma is None and model,
        min_confidence=confidence if model else 0.0,
    )
