"""The n-gram lookup: prompt lookup over the session's own tokens (:class:`specserve.core.ngram.NgramIndex`, a few
dictionary reads per lookup), as the session's proposer (``proposer="ngram"``) or as the hybrid lookup beside the
draft model (docs/design.md, "The hybrid lookup")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specserve.api.params import PROPOSER_KINDS
from specserve.coordinator.speculation.source import LocalSource, Source, SourceSetup
from specserve.core.ngram import NgramIndex


class Ngram(LocalSource):
    """Prompt lookup as the session's proposer (:meth:`specserve.core.ngram.NgramIndex.lookup`)."""

    name = "ngram"

    def __init__(self, prompt_token_ids: Iterable[int], *, max_n: int = 3, min_n: int = 1) -> None:
        super().__init__()
        self._index = NgramIndex(prompt_token_ids, max_n=max_n, min_n=min_n)

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        request = setup.request
        return cls(request.prompt_token_ids) if request.speculation.proposer == PROPOSER_KINDS["ngram"] else None

    def observe(self, tokens: Sequence[int]) -> None:
        self._index.extend(tokens)

    def shadow(self, n: int) -> tuple[int, ...]:
        return self._index.lookup(n)

    def ready(self) -> bool:
        return bool(self._index.lookup(1))


class HybridLookup(Ngram):
    """The lookup beside the draft model, with a tracker of its own: it learns from every round for free, so it
    starts from a cautious prior, and drafts no round before one of its guesses was seen to match (a request
    whose text never repeats pays nothing for it)."""

    prior = 0.3

    def __init__(self, prompt_token_ids: Iterable[int]) -> None:
        super().__init__(prompt_token_ids)
        self.matched = False  # a guess of it was seen to match (in a round it drafted, or in its shadow)

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        request = setup.request
        own = request.prediction_token_ids or request.speculation.proposer == PROPOSER_KINDS["ngram"]
        return cls(request.prompt_token_ids) if request.speculation.hybrid_lookup and not own else None

    def ready(self) -> bool:
        return self.matched and super().ready()

    def learn(self, *, proposed: int, accepted: int) -> None:
        super().learn(proposed=proposed, accepted=accepted)
        self.matched = self.matched or accepted > 0

    def branch(self, n: int, min_path_probability: float) -> tuple[int, ...]:
        """Its guess, as deep as each node's chance (its own acceptance to the power of the node's depth in the
        branch) stays at the round's threshold or above. No match need have been seen: a branch costs the round
        a few verified positions, which the threshold prices, not a round of its own."""
        assert self.tracker is not None
        alpha = self.tracker.alpha()
        depth, chance = 0, alpha
        while depth < n and chance >= min_path_probability and chance > 0.0:
            depth, chance = depth + 1, chance * alpha
        return self.shadow(depth) if depth else ()
