"""Repeat the last committed token: an opt-in source (``opt_in_sources=repeat``), and the proof that a source is one
module and one registration. It drafts runs of one token (indentation, a rule of dashes, a model stuck in a loop)
with no call, under the adaptive policy only, where its own acceptance, learnt from every round, makes that pay."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.coordinator.speculation.source import LocalSource, Source, SourceSetup


class RepeatLast(LocalSource):
    """Proposes the last committed token, again and again."""

    name = "repeat"
    opt_in = True
    prior = 0.3

    def __init__(self, last: int) -> None:
        super().__init__()
        self._last = last

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        request = setup.request
        return cls(request.prompt_token_ids[-1]) if request.speculation.gamma is None else None

    def observe(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._last = int(tokens[-1])

    def shadow(self, n: int) -> tuple[int, ...]:
        return (self._last,) * max(n, 0)

    def ready(self) -> bool:
        return True
