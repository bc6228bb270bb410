"""Forced text drafted for free: where a constrained session's grammar allows one continuation only (a JSON key and
its punctuation, the end of an object), that continuation tokenised as the target would most likely tokenise it,
and the end-of-sequence token after it when that is all the grammar then allows (``ConstraintMatcher.forced_tokens``,
:mod:`specserve.engine.grammar`). The proposal is a point mass verified like any other, so a guess the target
tokenises otherwise is rejected and costs nothing but the positions it filled."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specserve.coordinator.speculation.source import LocalSource, Source, SourceSetup


class ForcedText(LocalSource):
    """A constrained session's forced text. Its tracker starts confident (the target's own tokens usually spell
    what the grammar allows alone) and opens at the best rung for that prior; a wrong guess costs no call."""

    name = "forced"
    prior = 0.9
    warm_start = True

    def __init__(self, matcher: Any, encode: Callable[[str], Sequence[int]]) -> None:
        super().__init__()
        self._matcher = matcher
        self._encode = encode
        self._forced: tuple[int, ...] | None = None  # the forced tokens at the committed tokens observed
        self._lost = False  # a committed token left the grammar (no mask on p would allow it): offer nothing

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        if setup.matcher is None or setup.encode is None:
            return None
        return cls(setup.matcher(), setup.encode)

    def observe(self, tokens: Sequence[int]) -> None:
        self._forced = None
        for token in tokens:
            if self._lost or not self._matcher.accept(int(token)):
                self._lost = True
                return

    def _tokens(self) -> tuple[int, ...]:
        if self._forced is None:
            self._forced = () if self._lost else self._matcher.forced_tokens(self._encode)
        return self._forced

    def shadow(self, n: int) -> tuple[int, ...]:
        return self._tokens()[:n] if n > 0 else ()

    def ready(self) -> bool:
        return bool(self._tokens())
