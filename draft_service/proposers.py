"""Proposers: one small class per way of drafting tokens, behind one short interface.

A proposer gets a session's committed tokens ``C`` and drafts up to ``gamma``
tokens after them, returning a :class:`Drafted` (the tokens and the exact float32
vectors they were sampled from, or ``None`` for point masses). It never sees the
verifier: the target rebuilds ``q`` from the wire form with
``specserve.verification.draft_probs_from_pb`` (STYLE.md 4).

* :class:`ModelProposer`: the draft model. It samples ``x_i`` from its own logits
  processed exactly as the target processes its own (``SamplingParams``),
  optionally truncated to ``draft_top_k``; the vector it samples from is the one
  it ships (:func:`draft_distribution`).
* :class:`NgramProposer`: prompt lookup (no model). It finds the latest earlier
  occurrence of the last ``n`` tokens of ``C`` (``n`` from ``max_n`` down to
  ``min_n``) and proposes what followed it, as point masses.

Randomness: the token at absolute position ``j`` is drawn with
``uniform(seed, j, Purpose.DRAFT)`` (``specserve.rng``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specserve.errors import InvalidArgument
from specserve.kvcache import SessionCacheStore
from specserve.params import SamplingParams
from specserve.rng import Purpose, uniform
from specserve.sampling import check_distribution, logits_to_probs, sample_from
from specserve.v1 import common_pb2


@dataclass(frozen=True, eq=False)
class Drafted:
    """What a proposer drafted after ``C``."""

    token_ids: tuple[int, ...]
    probs_f32: torch.Tensor | None  # [gamma, vocab] float32 wire vectors; None = point mass on each token
    sparse: bool = False  # ship the non-zero support instead of dense bytes
    prefill_tokens: int = 0  # tokens fed to catch up with C


@dataclass(frozen=True)
class DraftRequest:
    """One proposal to make: the session, its full committed tokens and the sampling settings."""

    session_id: str
    committed: tuple[int, ...]  # C, never empty
    gamma: int
    sampling: SamplingParams
    seed: int
    draft_top_k: int = 0


def draft_distribution(
    logits: torch.Tensor, params: SamplingParams, context, draft_top_k: int
) -> torch.Tensor:
    """The float32 vectors the draft samples from and ships: ``[N, vocab]`` -> ``[N, vocab]`` float32.

    ``logits_to_probs`` (the session's processing), then, when ``draft_top_k > 0``,
    keep the ``draft_top_k`` most likely tokens (a stable sort: on ties the lowest
    ids win) and renormalise, then cast to float32 (the wire form). The caller
    samples from ``check_distribution`` of the result, exactly what the target rebuilds.
    """
    probs = logits_to_probs(logits, params, context)  # [N, vocab] float64
    if draft_top_k > 0 and draft_top_k < probs.shape[-1]:
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices  # [N, vocab]
        keep = order[:, :draft_top_k]  # [N, k]
        truncated = torch.zeros_like(probs)  # [N, vocab]
        truncated.scatter_(-1, keep, probs.gather(-1, keep))
        probs = truncated / truncated.sum(dim=-1, keepdim=True)  # [N, vocab]
    return probs.to(torch.float32)  # [N, vocab] float32


def ngram_lookup(tokens: Sequence[int], gamma: int, *, max_n: int = 3, min_n: int = 1) -> tuple[int, ...]:
    """Prompt lookup: what followed the latest earlier occurrence of the last ``n`` tokens.

    Tries ``n = max_n`` down to ``min_n``; for the first ``n`` with a match, returns
    up to ``gamma`` tokens that followed the latest match that is not the suffix
    itself. Returns ``()`` when nothing matches.
    """
    length = len(tokens)
    if gamma <= 0:
        return ()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        # Latest start i < length - n whose n tokens equal the suffix.
        for i in range(length - n - 1, -1, -1):
            if tokens[i] == suffix[0] and list(tokens[i : i + n]) == suffix:
                follow = tuple(int(t) for t in tokens[i + n : i + n + gamma])
                if follow:
                    return follow
    return ()


class Proposer(abc.ABC):
    """Drafts tokens after a session's committed prefix."""

    #: The ``ProposerKind`` this class implements.
    kind: ClassVar[int]

    @abc.abstractmethod
    def propose(self, request: DraftRequest) -> Drafted:
        """Draft up to ``request.gamma`` tokens after ``request.committed``."""

    def release(self, session_id: str) -> bool:
        """Drop per-session state; ``False`` when there was none."""
        return False


class ModelProposer(Proposer):
    """The small draft model, with a KV cache per session (:class:`~specserve.kvcache.SessionCacheStore`).

    After a proposal the session's cache holds ``C + x1..x_{gamma-1}`` (the branch);
    the next reconcile keeps whichever of those tokens were committed. Near the
    model's context limit it proposes fewer tokens, so that ``C + x1..x_gamma``
    still fits in ``max_position_embeddings``.
    """

    kind = common_pb2.PROPOSER_KIND_MODEL

    def __init__(self, caches: SessionCacheStore) -> None:
        self.caches = caches

    def propose(self, request: DraftRequest) -> Drafted:
        cache, _created = self.caches.get_or_create(request.session_id)
        reconciled = cache.reconcile(request.committed)
        gamma = request.gamma
        if cache.max_positions is not None:  # the target must be able to feed C + x1..x_gamma
            gamma = max(0, min(gamma, cache.max_positions - len(request.committed)))
        logits = reconciled.logits  # [vocab]
        assert logits is not None
        params = request.sampling
        base = len(request.committed)
        context = list(request.committed)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(gamma):
            q32 = draft_distribution(
                logits.unsqueeze(0), params, [context], request.draft_top_k
            )  # [1, vocab]
            if params.greedy:
                token = int(q32[0].argmax())
            else:
                q = check_distribution(q32[0])  # [vocab] float64, what the target rebuilds
                token = sample_from(q, uniform(request.seed, base + i, Purpose.DRAFT))
                rows.append(q32[0])
            tokens.append(token)
            context.append(token)
            if i + 1 < gamma:
                logits = cache.extend([token])[-1]  # [vocab]
        self.caches.trim(protect=(request.session_id,))
        probs = None if params.greedy or not tokens else torch.stack(rows)  # [gamma, vocab] float32
        return Drafted(
            token_ids=tuple(tokens),
            probs_f32=probs,
            sparse=request.draft_top_k > 0,
            prefill_tokens=reconciled.fed,
        )

    def release(self, session_id: str) -> bool:
        if session_id not in self.caches:
            return False
        self.caches.release(session_id)
        return True


class NgramProposer(Proposer):
    """Prompt lookup over the session's own tokens; point-mass proposals, no model."""

    kind = common_pb2.PROPOSER_KIND_NGRAM

    def __init__(self, *, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise InvalidArgument(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, request: DraftRequest) -> Drafted:
        tokens = ngram_lookup(request.committed, request.gamma, max_n=self.max_n, min_n=self.min_n)
        return Drafted(token_ids=tokens, probs_f32=None)
