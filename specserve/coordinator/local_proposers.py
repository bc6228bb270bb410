"""Proposers that need no model: they run in the coordinator, with no draft call and no batch to wait for.

A :class:`LocalProposer` follows one session's committed tokens (its
:class:`~specserve.coordinator.session.Session` feeds it every newly committed token,
through the session's one mutator) and drafts from them at once, as point
masses (``Proposal.token_ids`` alone: the target accepts a token with its own
probability of it, and in the coupled sampling mode a point mass is just a
deterministic proposal). :meth:`ProposalSources.propose <specserve.coordinator.sources.ProposalSources.propose>`
asks a session's local proposers first, in order, and the draft model only
when none has anything to offer (and the session drafts with the model).

* :class:`NgramProposer`: prompt lookup over the session's own tokens (prompt
  and completion), :class:`specserve.core.ngram.NgramIndex` kept per session, so a
  lookup costs a few dictionary reads.
* :class:`ForcedTextProposer`: a constrained session's forced text (the
  round loop chooses it beside the session's own proposer, with its own
  acceptance, as it does the hybrid lookup).
* :class:`PredictionProposer`: Predicted Outputs. The prediction is tokenized
  once per session (``specserve/coordinator/requests.py``) and indexed once. The
  proposer keeps an *alignment*: the index in the prediction of the
  completion's next token. While the completion follows the prediction the
  alignment advances token by token and each round drafts the prediction's
  next tokens; when a committed token differs, the alignment is lost and is
  re-found like prompt lookup: the longest suffix of the completion (from
  ``max_n`` = 4 tokens down to ``min_n`` = 2: a single common token such as a
  newline is too weak a clue; docs/benchmarks/history.md, "Figures moved out
  of the code") that occurs in the prediction, its first occurrence
  at or after the point where the alignment was lost (edits move forward
  through a file), else its latest one before. The prediction is indexed
  once (:class:`~specserve.core.ngram.NgramIndex`), so following the alignment
  costs one comparison per committed token and re-aligning a few dictionary
  reads. Until it is re-found (or once the
  prediction is used up) the proposer offers nothing and the session's own
  proposer drafts.

Counting (``GenerationStats``, the HTTP ``usage.completion_tokens_details``):
``accepted_prediction_tokens`` are completion tokens the prediction predicted
at their place while aligned (drafted from it and accepted, or the target's
own token where it equals the prediction's next one, e.g. the bonus token);
``rejected_prediction_tokens`` are tokens drafted from the prediction that
were not committed (rejected by verification, or cut by a stop): target work
the prediction cost.

Pure Python: no torch, no gRPC, no logging (the forced-text proposer's matcher is handed in).
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from specserve.core.ngram import NgramIndex


class LocalProposer(abc.ABC):
    """Drafts from a session's committed tokens alone (no model); one instance per session."""

    #: The proposer's name in logs and metrics.
    name: ClassVar[str]

    @abc.abstractmethod
    def observe(self, new_tokens: Sequence[int]) -> None:
        """Tokens just committed after the ones observed before (the session calls this, in order)."""

    @abc.abstractmethod
    def peek(self, gamma: int) -> tuple[int, ...]:
        """What :meth:`propose` would offer now, recording nothing (the round loop's guess at gamma 0)."""

    def propose(self, gamma: int) -> tuple[int, ...]:
        """Up to ``gamma`` tokens to follow the committed ones (``()``: nothing to offer)."""
        return self.peek(gamma)

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether :meth:`propose` would offer tokens now (for a gamma of at least 1)."""


class NgramProposer(LocalProposer):
    """Prompt lookup over the session's prompt and completion (:meth:`specserve.core.ngram.NgramIndex.lookup`)."""

    name = "ngram"

    def __init__(self, prompt_token_ids: Iterable[int], *, max_n: int = 3, min_n: int = 1) -> None:
        self._index = NgramIndex(prompt_token_ids, max_n=max_n, min_n=min_n)

    def observe(self, new_tokens: Sequence[int]) -> None:
        self._index.extend(new_tokens)

    def peek(self, gamma: int) -> tuple[int, ...]:
        return self._index.lookup(gamma)

    @property
    def ready(self) -> bool:
        return bool(self._index.lookup(1))


class PredictionProposer(LocalProposer):
    """Predicted Outputs: the prediction's tokens after its alignment with the completion (module docstring)."""

    name = "prediction"

    def __init__(self, prediction: Sequence[int], *, max_n: int = 4, min_n: int = 2) -> None:
        self._prediction = tuple(int(t) for t in prediction)
        self._index = NgramIndex(self._prediction, max_n=max_n, min_n=min_n)
        self._recent: deque[int] = deque(maxlen=max_n)  # the completion's last tokens, for re-alignment
        #: Index in the prediction of the completion's next token; None: not aligned.
        self._next: int | None = 0
        #: Where the alignment was last lost (re-alignment looks forward from here first).
        self._lost_at = 0
        self._pending = 0  # tokens of the last proposal whose round has not committed yet
        self.accepted_tokens = 0
        self.rejected_tokens = 0

    @property
    def alignment(self) -> int | None:
        """Index in the prediction of the completion's next token (None: not aligned)."""
        return self._next

    def observe(self, new_tokens: Sequence[int]) -> None:
        """Follow the alignment over the committed tokens, count, and re-align once it is lost."""
        if not new_tokens:
            return
        matched = 0  # leading new tokens the prediction predicted
        for token in new_tokens:
            if self._next is not None and self._next < len(self._prediction) and self._prediction[self._next] == token:
                self._next += 1
                matched += 1
            elif self._next is not None:
                self._lost_at = self._next
                self._next = None
            self._recent.append(int(token))
        self.accepted_tokens += matched
        self.rejected_tokens += max(0, self._pending - matched)
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

    def peek(self, gamma: int) -> tuple[int, ...]:
        if self._next is None or gamma <= 0:
            return ()
        return self._prediction[self._next : self._next + gamma]

    def propose(self, gamma: int) -> tuple[int, ...]:
        tokens = self.peek(gamma)
        self._pending = len(tokens)  # counted as rejected unless the round commits them
        return tokens

    @property
    def ready(self) -> bool:
        return self._next is not None and self._next < len(self._prediction)


class ForcedTextProposer(LocalProposer):
    """Forced text drafted for free: where a constrained session's grammar allows one continuation only (a
    JSON key and its punctuation, the end of an object), that continuation tokenised as the target would most
    likely tokenise it (``encode``), and the end-of-sequence token after it when that is all the grammar then
    allows (``ConstraintMatcher.forced_tokens``, :mod:`specserve.engine.grammar`).

    The matcher follows the committed tokens (:meth:`observe`); the proposal is a point mass verified like
    any other, so a guess the target tokenises otherwise is rejected and costs nothing but the positions it
    filled. Its own acceptance is kept with the proposal sources (``specserve/coordinator/sources.py``).
    """

    name = "forced"

    def __init__(self, matcher: Any, encode: Callable[[str], Sequence[int]]) -> None:
        self._matcher = matcher
        self._encode = encode
        self._forced: tuple[int, ...] | None = None  # the forced tokens at the committed tokens observed
        self._lost = False  # a committed token left the grammar (no mask on p would allow it): offer nothing

    def observe(self, new_tokens: Sequence[int]) -> None:
        self._forced = None
        for token in new_tokens:
            if self._lost or not self._matcher.accept(int(token)):
                self._lost = True
                return

    def _tokens(self) -> tuple[int, ...]:
        if self._forced is None:
            self._forced = () if self._lost else self._matcher.forced_tokens(self._encode)
        return self._forced

    def peek(self, gamma: int) -> tuple[int, ...]:
        return self._tokens()[:gamma] if gamma > 0 else ()

    @property
    def ready(self) -> bool:
        return bool(self._tokens())
