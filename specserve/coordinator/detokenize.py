"""Incremental detokenization: text deltas that never split a multi-byte character.

A byte-level tokenizer can split one UTF-8 character over several tokens; the
first tokens alone decode to U+FFFD. :class:`IncrementalDetokenizer` decodes a
small window of recent tokens, and holds text back while the window ends in an
incomplete character (U+FFFD at the end), so the concatenation of the deltas is
the decoded completion and no delta ever carries half a character.

Stop strings: when a generation ends on a stop string, :meth:`finish` cuts the
text at the end of the first match (the target already cut the tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns committed completion tokens into text deltas (one instance per session).

    ``push(token_ids)`` returns the text that became complete; ``finish()``
    returns whatever was held back (and applies the stop-string cut). The
    window technique follows Hugging Face ``text-generation-inference``:
    ``prefix_offset`` marks tokens decoded only for context, ``read_offset``
    the tokens whose text was already emitted.
    """

    def __init__(self, tokenizer: Any, *, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._stop_strings = tuple(stop_strings)
        self._skip = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []
        self._stopped = False

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._emitted)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly committed tokens; return the text delta that is now whole ("" if none)."""
        if self._stopped:
            return ""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing whole yet
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return self._emit(delta)

    def finish(self) -> str:
        """The held-back remainder at the end of the generation (stop string cut applied)."""
        if self._stopped:
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        self._read_offset = self._prefix_offset = len(self._tokens)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if not self._stop_strings or not delta:
            self._emitted.append(delta)
            return delta
        # A stop string may straddle deltas: search the emitted tail plus the delta.
        longest = max(len(s) for s in self._stop_strings)
        before = self.text
        tail = before[-(longest - 1) :] if longest > 1 else ""
        window = tail + delta
        ends = [window.find(s) + len(s) for s in self._stop_strings if s in window]
        if ends:
            cut = min(ends) - len(tail)
            delta = delta[: max(cut, 0)]
            self._stopped = True
        self._emitted.append(delta)
        return delta
