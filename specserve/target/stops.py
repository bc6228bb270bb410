"""Stop conditions: where a round's new tokens must be cut so nothing after a stop is committed.

A round yields new tokens (accepted draft tokens, then the correction or bonus
token). :func:`cut_at_stop` walks them in order and keeps each until one of
them ends the generation; that token is kept (the stop token is emitted) and
nothing after it. At one token the reasons are checked in this order: the
model's end-of-sequence token (unless ``ignore_eos``), a token of
``stop_token_ids``, a stop string completed in the decoded completion, and
``max_new_tokens`` reached (counted after the prompt).

Stop strings are matched in the completion's text (tokens after the prompt,
decoded without special tokens). A stop string can only be completed by a new
token, so only a tail of the old completion is decoded with the new tokens:
enough tokens that any match ending in the new text is wholly inside it (a
character is at most 4 bytes and every token at least one byte for byte-level
tokenizers; a few more tokens cover other tokenizers' context effects). Special
tokens decode to nothing, so the tail is counted in the other tokens: a stop
string split by any number of special tokens is still found. The window is
decoded once per round; only a round that completes a stop string is walked
token by token to find the one that completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.api.params import FINISH_REASONS, NOT_FINISHED, StopConditions

#: Old completion tokens decoded before the new ones, beyond 4 per stop-string character.
_TAIL_SLACK_TOKENS = 8


@dataclass(frozen=True)
class StopCut:
    """The part of a round's new tokens that may be committed."""

    token_ids: tuple[int, ...]
    finish_reason: int  # a FinishReason; NOT_FINISHED while the session continues


def cut_at_stop(
    new_token_ids: Sequence[int],
    *,
    completion_token_ids: Sequence[int],
    stop: StopConditions,
    eos_token_ids: frozenset[int],
    tokenizer: Any | None,
) -> StopCut:
    """Keep ``new_token_ids`` up to and including the first one that ends the generation.

    ``completion_token_ids`` are the tokens already generated after the prompt
    (committed before this round); ``tokenizer`` decodes for ``stop.stop_strings``
    and may be None only when there are none.
    """
    stop_ids = frozenset(stop.stop_token_ids)
    eos = frozenset() if stop.ignore_eos else eos_token_ids
    tail: list[int] = []
    strings = False  # whether this round completes a stop string at all
    if stop.stop_strings:
        if tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        width = 4 * max(len(s) for s in stop.stop_strings) + _TAIL_SLACK_TOKENS
        tail = _text_tail(completion_token_ids, width, frozenset(getattr(tokenizer, "all_special_ids", ())))
        strings = _contains_stop_string(tokenizer, tail + list(new_token_ids), stop.stop_strings)
    generated = len(completion_token_ids)
    kept: list[int] = []
    for token in new_token_ids:
        kept.append(token)
        generated += 1
        reason = NOT_FINISHED
        if token in eos:
            reason = FINISH_REASONS["eos"]
        elif token in stop_ids:
            reason = FINISH_REASONS["stop_token"]
        elif strings and _contains_stop_string(tokenizer, tail + kept, stop.stop_strings):
            reason = FINISH_REASONS["stop_string"]
        elif generated >= stop.max_new_tokens:
            reason = FINISH_REASONS["length"]
        if reason != NOT_FINISHED:
            return StopCut(tuple(kept), reason)
    return StopCut(tuple(kept), NOT_FINISHED)


def _text_tail(token_ids: Sequence[int], width: int, special: frozenset[int]) -> list[int]:
    """The shortest tail of ``token_ids`` holding ``width`` tokens that are not special (all of them if fewer)."""
    seen = 0
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] not in special:
            seen += 1
            if seen == width:
                return list(token_ids[i:])
    return list(token_ids)


def _contains_stop_string(tokenizer: Any, token_ids: list[int], stop_strings: Sequence[str]) -> bool:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return any(s in text for s in stop_strings)
