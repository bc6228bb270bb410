"""The OpenAI API's reply bodies, built from the events of a request's sessions.

:class:`ReplyBuilder` takes each choice's :class:`~specserve.coordinator.coordinator.Chunk` and
:class:`~specserve.coordinator.coordinator.Finished` events in arrival order and returns the streaming chunks
they become, then the usage chunk or the whole non-streamed reply: logprobs in OpenAI's shapes
(:class:`TokenStrings` gives each token's text and bytes), a forced tool call as ``tool_calls``, and the
``speculation`` extension (:func:`speculation_report`). Pure data: no HTTP, no sessions. The shapes:
docs/operations.md, "The OpenAI-compatible HTTP API".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from specserve.api.params import PositionLogprobs
from specserve.api.stats import GenerationStats
from specserve.coordinator.coordinator import Chunk, Finished
from specserve.coordinator.openai_protocol import ReplyOptions
from specserve.coordinator.structured_outputs import ToolCallText

_STOPPED = ("eos", "stop_token", "stop_string")


def finish_reason(stats: GenerationStats, *, tool_call: bool = False) -> str:
    """OpenAI's ``finish_reason``: ``stop`` (EOS, a stop token or string; ``tool_calls`` for a tool call) or
    ``length``."""
    if stats.finish_reason not in _STOPPED:
        return "length"
    return "tool_calls" if tool_call else "stop"


def usage(stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """``usage`` over the choices of one request (the prompt counted once, as OpenAI does).

    ``completion_tokens_details`` holds the Predicted Outputs counts (0 without a prediction):
    accepted, completion tokens the prediction predicted at their place; rejected, tokens drafted
    from the prediction that were not committed. ``prompt_tokens_details.cached_tokens``: prompt
    tokens the target did not prefill because its prefix cache held them (the fewest over the choices).
    """
    prompt = stats[0].prompt_tokens if stats else 0
    completion = sum(s.completion_tokens for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": min((s.cached_tokens for s in stats), default=0)},
        "completion_tokens_details": {
            "accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in stats),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in stats),
        },
    }


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenStrings:
    """Each token's text and exact bytes, as OpenAI's logprobs show them (cached per token id).

    A byte-level BPE tokenizer (GPT-2's alphabet) gives the token's own bytes even when they are
    part of a multi-byte character (the text then shows the replacement character); any other
    tokenizer gives the UTF-8 of the token decoded alone.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._table = _byte_level_table() if self._byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._render(token_id)
            self._cache[token_id] = found
        return found

    def _render(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._table for c in piece):
                raw = bytes(self._table[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self._tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[PositionLogprobs], strings: TokenStrings) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [...], "refusal": None}``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = strings(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top_logprobs]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[PositionLogprobs], strings: TokenStrings, offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (the legacy shape); ``offset``: characters before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        text, _ = strings(e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{strings(t.token_id)[0]: t.logprob for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def speculation_report(stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """The speculation figures of these sessions, named like vLLM's spec-decode metrics.

    ``num_drafts``: rounds that proposed at least one draft token; ``num_draft_tokens``: tokens
    proposed; ``num_accepted_tokens``: proposed tokens the target accepted;
    ``num_accepted_tokens_per_pos[i]``: drafts whose token at position ``i`` was accepted;
    ``mean_acceptance_length``: tokens committed per draft round, ``1 + accepted / drafts``
    (vLLM's definition; 1.0 without drafts); ``rounds``: all rounds, gamma = 0 ones included;
    ``sources``: per proposal source (by name), its ``num_drafts``, ``num_draft_tokens`` and
    ``num_accepted_tokens``.
    """
    per_pos: list[int] = []
    for s in stats:
        for i, count in enumerate(s.accepted_per_position):
            if i == len(per_pos):
                per_pos.append(0)
            per_pos[i] += count
    drafts = sum(s.draft_rounds for s in stats)
    proposed = sum(s.proposed_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    sources: dict[str, dict[str, int]] = {}
    for s in stats:
        for row in s.sources:
            into = sources.setdefault(row.name, {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})
            into["num_drafts"] += row.draft_rounds
            into["num_draft_tokens"] += row.proposed_tokens
            into["num_accepted_tokens"] += row.accepted_tokens
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "rounds": sum(s.rounds for s in stats),
        "sources": sources,
    }


class StopTrimmer:
    """Text of one choice with the stop string left out, as OpenAI returns it.

    The coordinator's text ends *with* a stop string that ended the generation;
    OpenAI's does not. A chunk does not say whether it is the last, so while
    streaming the last ``len(longest stop string)`` characters are held back
    (they might be the stop string) and released once more text follows; at the
    end the stop string is cut off.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(stop_strings)
        self._hold = max((len(s) for s in self._stops), default=0)
        self._pending = ""

    def push(self, text: str) -> str:
        """Add a delta; returns what can be sent now."""
        self._pending += text
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def finish(self, stats: GenerationStats) -> str:
        """The held-back rest, without the stop string if one ended the generation."""
        rest, self._pending = self._pending, ""
        if stats.finish_reason == "stop_string":
            ends = [s for s in self._stops if rest.endswith(s)]
            if ends:
                rest = rest[: len(rest) - max(len(s) for s in ends)]
        return rest


class ReplyBuilder:
    """The reply bodies of one request with ``n`` choices (``kind``: the endpoint)."""

    def __init__(
        self,
        kind: Literal["chat", "completion"],
        *,
        model: str,
        n: int,
        options: ReplyOptions | None = None,
        prompt_tokens: int = 0,
        token_strings: TokenStrings | None = None,
    ) -> None:
        """``token_strings``: render logprobs (the request asked for them); None: ``"logprobs": null``.
        ``prompt_tokens``: the prompt's length, for the usage of ``options.continuous_usage``."""
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        options = options or ReplyOptions()
        self.include_usage = options.include_usage
        self.continuous_usage = options.continuous_usage
        self._prompt_tokens = prompt_tokens
        self._completion_tokens = 0  # tokens of every choice's chunks so far (continuous usage)
        self._strings = token_strings
        self._trimmers = [StopTrimmer(options.trim_stop_strings) for _ in range(n)]
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[list[PositionLogprobs]] = [[] for _ in range(n)]
        self._offsets = [0] * n  # characters of token text before each choice's next logprobs (completions)
        self._stats: list[GenerationStats | None] = [None] * n
        self._started = [False] * n
        shape = getattr(options, "tool_call", None) if kind == "chat" else None
        #: Each choice's text as a tool call (None: text replies).
        self._calls = [ToolCallText(shape) for _ in range(n)] if shape is not None else None

    @property
    def finished(self) -> bool:
        return all(s is not None for s in self._stats)

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            **extra,
        }
        if self.continuous_usage:
            body["usage"] = {
                "prompt_tokens": self._prompt_tokens,
                "completion_tokens": self._completion_tokens,
                "total_tokens": self._prompt_tokens + self._completion_tokens,
            }
        elif self.include_usage:
            body["usage"] = None
        return body

    def _delta(
        self,
        index: int,
        text: str | None,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def _render_logprobs(self, index: int, entries: Sequence[PositionLogprobs]) -> dict[str, Any] | None:
        """The ``logprobs`` of these entries of choice ``index`` (None when the request did not ask)."""
        if self._strings is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self._strings)
        rendered = completion_logprobs(entries, self._strings, self._offsets[index])
        self._offsets[index] += sum(len(t) for t in rendered["tokens"])
        return rendered

    def on_event(self, index: int, event: Chunk | Finished) -> list[dict[str, Any]]:
        """Record one event of choice ``index``; returns the stream chunks it becomes."""
        out: list[dict[str, Any]] = []
        if not self._started[index]:
            self._started[index] = True
            if self.kind == "chat":
                content = None if self._calls is not None else ""
                role = {"index": index, "delta": {"role": "assistant", "content": content}}
                out.append(self._chunk({**role, "logprobs": None, "finish_reason": None}))
        trimmer = self._trimmers[index]
        if isinstance(event, Chunk):
            self._completion_tokens += len(event.token_ids)
            text = trimmer.push(event.text)
            if text:
                self._texts[index].append(text)
            self._logprobs[index].extend(event.logprobs)
            logprobs = self._render_logprobs(index, event.logprobs) if event.logprobs else None
            calls = self._calls[index].push(text) if self._calls is not None and text else None
            if self._calls is not None:
                text = None  # the text goes out as the tool call's arguments
            if text or calls or logprobs is not None:  # a chunk's logprobs go out with it, its text held back or not
                out.append(self._chunk(self._delta(index, text, logprobs=logprobs, tool_calls=calls)))
            return out
        stats = event.stats
        self._stats[index] = stats
        rest = trimmer.finish(stats)
        if rest:
            self._texts[index].append(rest)
        calls: list[dict[str, Any]] = []
        if self._calls is not None:
            stopped = stats.finish_reason in _STOPPED
            calls = self._calls[index].push(rest) if rest else []
            more, rest = self._calls[index].finish(stopped)
            calls += more
        if rest or calls:
            out.append(self._chunk(self._delta(index, rest or None, tool_calls=calls)))
        last = self._delta(index, None, finish_reason(stats, tool_call=self._is_call(index)))
        out.append(self._chunk({**last, "speculation": speculation_report([stats])}))
        return out

    def _is_call(self, index: int) -> bool:
        """Choice ``index`` is a tool call whose function is known."""
        if self._calls is None:
            return False
        message = self._calls[index].message(self.text(index), stopped=True)
        return "tool_calls" in message

    def _all_stats(self) -> list[GenerationStats]:
        return [s for s in self._stats if s is not None]

    def usage_chunk(self) -> dict[str, Any]:
        """The last stream chunk when ``include_usage``: no choices, the request's usage."""
        stats = self._all_stats()
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(stats),
            "speculation": speculation_report(stats),
        }

    def text(self, index: int) -> str:
        return "".join(self._texts[index])

    def reply(self) -> dict[str, Any]:
        """The whole non-streamed reply (every choice finished)."""
        choices = []
        for i, stats in enumerate(self._stats):
            assert stats is not None, "reply() before every choice finished"
            choice: dict[str, Any] = {"index": i}
            if self._calls is not None:
                choice["message"] = self._calls[i].message(self.text(i), stats.finish_reason in _STOPPED)
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": self.text(i)}
            else:
                choice["text"] = self.text(i)
            self._offsets[i] = 0
            logprobs = self._render_logprobs(i, self._logprobs[i])
            choice.update(
                logprobs=logprobs,
                finish_reason=finish_reason(stats, tool_call=self._is_call(i)),
                speculation=speculation_report([stats]),
            )
            choices.append(choice)
        stats_all = self._all_stats()
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(stats_all),
            "speculation": speculation_report(stats_all),
        }
