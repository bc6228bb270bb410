"""A client's generation request as a checked domain object (``GenerateRequest.from_pb``).

Every check raises :class:`~specserve.errors.InvalidArgument` with a message
that says what to fix; the server interceptor turns it into INVALID_ARGUMENT.
Limits come from :class:`~specserve.config.CoordinatorSettings` (passed in, never
read from the environment here).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from specserve.config import CoordinatorSettings
from specserve.errors import InvalidArgument
from specserve.params import SamplingParams, StopConditions
from specserve.v1 import common_pb2, coordinator_pb2

#: Proposer kinds the coordinator knows; UNSPECIFIED means the draft model.
_PROPOSERS = {
    common_pb2.PROPOSER_KIND_UNSPECIFIED: common_pb2.PROPOSER_KIND_MODEL,
    common_pb2.PROPOSER_KIND_MODEL: common_pb2.PROPOSER_KIND_MODEL,
    common_pb2.PROPOSER_KIND_NGRAM: common_pb2.PROPOSER_KIND_NGRAM,
}


def random_seed() -> int:
    """A fresh 63-bit seed (fits signed 64-bit stores and JSON readers)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class SpeculationSettings:
    """How a session speculates: ``gamma`` fixed, or None for the automatic policy."""

    gamma: int | None
    proposer: int  # common_pb2.ProposerKind, never UNSPECIFIED
    draft_top_k: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate request: prompt tokens, sampling (seed fixed), stops, speculation."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: StopConditions
    speculation: SpeculationSettings

    @classmethod
    def from_pb(
        cls,
        pb: coordinator_pb2.GenerateRequest,
        *,
        settings: CoordinatorSettings,
        tokenizer: Any,
        vocab_size: int,
        max_gamma: int,
    ) -> GenerationRequest:
        """Check ``pb`` against the server's limits; tokenize a text prompt."""
        which = pb.WhichOneof("prompt")
        if which == "text":
            if not pb.text:
                raise InvalidArgument("the prompt is empty: send prompt text or prompt token ids")
            prompt = tuple(tokenizer.encode(pb.text, add_special_tokens=False))
            if not prompt:
                raise InvalidArgument("the prompt text tokenizes to no tokens: send a non-empty prompt")
        elif which == "tokens":
            prompt = tuple(pb.tokens.token_ids)
            if not prompt:
                raise InvalidArgument("the prompt is empty: send at least one prompt token id")
            bad = [t for t in prompt if t >= vocab_size]
            if bad:
                raise InvalidArgument(
                    f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab_size} tokens "
                    f"(ids must be in [0, {vocab_size}))"
                )
        else:
            raise InvalidArgument("the prompt is empty: set GenerateRequest.text or GenerateRequest.tokens")
        if len(prompt) > settings.max_prompt_tokens:
            raise InvalidArgument(
                f"the prompt has {len(prompt)} tokens, more than this server's limit of "
                f"{settings.max_prompt_tokens}; shorten it"
            )
        if pb.stop.max_new_tokens > settings.max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens={pb.stop.max_new_tokens} is above this server's limit of "
                f"{settings.max_new_tokens_limit}; ask for at most {settings.max_new_tokens_limit}"
            )
        seed = random_seed()
        sampling = SamplingParams.from_pb(pb.sampling, default_seed=seed)
        stop = StopConditions.from_pb(pb.stop, default_max_new_tokens=settings.default_max_new_tokens)
        bad_stop = [t for t in stop.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise InvalidArgument(
                f"stop token id {bad_stop[0]} is outside the vocabulary of {vocab_size} tokens"
            )
        return cls(
            prompt_token_ids=prompt,
            sampling=sampling,
            stop=stop,
            speculation=_speculation_from_pb(pb.speculation, max_gamma=max_gamma, vocab_size=vocab_size),
        )


def _speculation_from_pb(pb: coordinator_pb2.SpeculationParams, *, max_gamma: int, vocab_size: int):
    if pb.proposer not in _PROPOSERS:
        known = ", ".join(common_pb2.ProposerKind.Name(k) for k in _PROPOSERS)
        raise InvalidArgument(f"unknown proposer {pb.proposer}; use one of {known}")
    gamma: int | None = None
    if pb.HasField("gamma"):
        gamma = pb.gamma
        if gamma > max_gamma:
            raise InvalidArgument(
                f"gamma={gamma} is above this server's maximum of {max_gamma}; "
                f"ask for 0..{max_gamma} or leave gamma unset for automatic"
            )
    if pb.draft_top_k > vocab_size:
        raise InvalidArgument(
            f"draft_top_k={pb.draft_top_k} exceeds the vocabulary size {vocab_size}; use 0 (off) or a smaller k"
        )
    return SpeculationSettings(gamma=gamma, proposer=_PROPOSERS[pb.proposer], draft_top_k=pb.draft_top_k)
