"""n-gram lookup over token sequences: the one implementation of prompt lookup.

:class:`NgramIndex` records where every n-gram (``min_n <= n <= max_n``) of a
growing token sequence starts, so that a lookup costs a few dictionary reads
instead of a scan of the sequence. Two kinds of proposer use it:

* **prompt lookup** (:meth:`NgramIndex.lookup`, :func:`ngram_lookup`): find the
  first occurrence of the sequence's last ``n`` tokens (``n`` from ``max_n``
  down to ``min_n``) and propose what followed it. The first, as Hugging Face's
  prompt lookup and vLLM's n-gram proposer take it: text being copied sits in
  the prompt, before any later repeat of a common n-gram (a closing code fence,
  an indented ``return``); where recent context repeats more (chat and code
  answers) the latest occurrence does a little better. The coordinator's
  n-gram proposer keeps one index per session and extends it as tokens commit
  (``specserve/coordinator/speculation/sources/ngram.py``); the draft's n-gram proposer, kept for older
  coordinators, builds one per call (``specserve/draft/proposers.py``).
* **Predicted Outputs** (:meth:`NgramIndex.occurrences`): the prediction is
  indexed once, and the coordinator re-aligns the completion with it by
  looking up the completion's last tokens (``specserve/coordinator/speculation/sources/prediction.py``).

Pure Python: no torch, no gRPC, no logging.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specserve.api.errors import InvalidArgument


class NgramIndex:
    """Start positions of every n-gram of a token sequence, ``min_n <= n <= max_n``, kept as it grows.

    ``extend`` appends tokens (``max_n - min_n + 1`` dictionary updates per token);
    ``occurrences(gram)`` lists a gram's start positions in increasing order.
    """

    def __init__(self, tokens: Iterable[int] = (), *, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise InvalidArgument(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``, indexing every n-gram that ends at one of them."""
        seq = self._tokens
        for token in tokens:
            seq.append(int(token))
            end = len(seq)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._starts.setdefault(tuple(seq[end - n :]), []).append(end - n)

    def occurrences(self, gram: Sequence[int]) -> list[int]:
        """Start positions of ``gram`` (``min_n <= len(gram) <= max_n``), increasing; empty if none."""
        return self._starts.get(tuple(gram), [])

    def lookup(self, gamma: int) -> tuple[int, ...]:
        """Prompt lookup: up to ``gamma`` tokens that followed the first occurrence of the suffix.

        Tries the last ``n`` tokens for ``n = max_n`` down to ``min_n``; for the
        first ``n`` that occurred before (a start other than the suffix's own),
        returns what followed its first occurrence. ``()`` when nothing matches.
        """
        length = len(self._tokens)
        if gamma <= 0:
            return ()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = self._starts.get(tuple(self._tokens[length - n :]), [])
            if len(starts) >= 2:  # the last start is the suffix itself
                i = starts[0]
                return tuple(self._tokens[i + n : i + n + gamma])
        return ()


def ngram_lookup(tokens: Sequence[int], gamma: int, *, max_n: int = 3, min_n: int = 1) -> tuple[int, ...]:
    """Prompt lookup over ``tokens`` in one call (:meth:`NgramIndex.lookup` of a fresh index).

    Returns up to ``gamma`` tokens that followed the first occurrence
    of the last ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that
    has one; ``()`` when nothing matches.
    """
    if gamma <= 0:
        return ()
    return NgramIndex(tokens, max_n=max_n, min_n=min_n).lookup(gamma)
