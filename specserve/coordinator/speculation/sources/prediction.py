"""Predicted Outputs: the request's prediction drafted where the completion follows it (docs/design.md).

The prediction is tokenized once per session (``specserve/coordinator/requests.py``) and indexed once. The source
keeps an *alignment*: the index in the prediction of the completion's next token. While the completion follows the
prediction the alignment advances token by token and each round drafts the prediction's next tokens; when a
committed token differs, the alignment is lost and re-found like prompt lookup: the longest suffix of the
completion (``max_n`` = 4 tokens down to ``min_n`` = 2: a single common token such as a newline is too weak a
clue) that occurs in the prediction, its first occurrence at or after where the alignment was lost (edits move
forward through a file), else its latest one before. Until then it offers nothing and the session's next
proposer drafts.

Counting (``GenerationStats``, the HTTP ``usage.completion_tokens_details``): ``accepted_prediction_tokens`` are
completion tokens the prediction predicted at their place while aligned; ``rejected_prediction_tokens`` are tokens
drafted from the prediction that were not committed (target work the prediction cost).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from specserve.coordinator.session import SessionStats
from specserve.coordinator.speculation.source import LocalSource, Source, SourceSetup
from specserve.core.ngram import NgramIndex


class Prediction(LocalSource):
    """The prediction's tokens after its alignment with the completion (module docstring)."""

    name = "prediction"

    def __init__(
        self, prediction: Sequence[int], *, max_n: int = 4, min_n: int = 2, stats: SessionStats | None = None
    ) -> None:
        super().__init__()
        self._prediction = tuple(int(t) for t in prediction)
        self._index = NgramIndex(self._prediction, max_n=max_n, min_n=min_n)
        self._recent: deque[int] = deque(maxlen=max_n)  # the completion's last tokens, for re-alignment
        #: Index in the prediction of the completion's next token; None: not aligned.
        self._next: int | None = 0
        #: Where the alignment was last lost (re-alignment looks forward from here first).
        self._lost_at = 0
        self._pending = 0  # tokens of the last proposal whose round has not committed yet
        self._stats = stats or SessionStats()  # where the counts are reported

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        tokens = setup.request.prediction_token_ids
        return cls(tokens, stats=setup.session.stats) if tokens else None

    @property
    def accepted_tokens(self) -> int:
        return self._stats.accepted_prediction_tokens

    @property
    def rejected_tokens(self) -> int:
        return self._stats.rejected_prediction_tokens

    @property
    def alignment(self) -> int | None:
        """Index in the prediction of the completion's next token (None: not aligned)."""
        return self._next

    def observe(self, tokens: Sequence[int]) -> None:
        """Follow the alignment over the committed tokens, count, and re-align once it is lost."""
        if not tokens:
            return
        matched = 0  # leading new tokens the prediction predicted
        for token in tokens:
            if self._next is not None and self._next < len(self._prediction) and self._prediction[self._next] == token:
                self._next += 1
                matched += 1
            elif self._next is not None:
                self._lost_at = self._next
                self._next = None
            self._recent.append(int(token))
        self._stats.accepted_prediction_tokens += matched
        self._stats.rejected_prediction_tokens += max(0, self._pending - matched)
        self._pending = 0
        if self._next is None:
            self._next = self._realign()

    def _realign(self) -> int | None:
        """The prediction index after the longest suffix of the completion found in it, or None."""
        recent = list(self._recent)
        for n in range(min(len(recent), self._index.max_n), self._index.min_n - 1, -1):
            starts = self._index.occurrences(recent[len(recent) - n :])
            if not starts:
                continue
            ahead = [s for s in starts if s >= self._lost_at]
            start = ahead[0] if ahead else starts[-1]
            return start + n
        return None

    def shadow(self, n: int) -> tuple[int, ...]:
        if self._next is None or n <= 0:
            return ()
        return self._prediction[self._next : self._next + n]

    def draft(self, gamma: int) -> tuple[int, ...]:
        tokens = self.shadow(gamma)
        self._pending = len(tokens)  # counted as rejected unless the round commits them
        return tokens

    def ready(self) -> bool:
        return self._next is not None and self._next < len(self._prediction)
