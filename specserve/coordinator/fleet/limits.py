"""The limits a coordinator runs with, probed once from the workers it reaches at start-up.

:func:`probe_limits` asks every replica for its model facts and limits
(``GetDraftInfo`` / ``GetTargetInfo``; a replica that does not answer within
:data:`INFO_TIMEOUT_S` is left out and used once it is up), refuses a worker
whose vocabulary differs from the target's
(:class:`~specserve.api.errors.VocabularyMismatch`) and a draft whose feature head reads another feature
than a target returns (:func:`check_features`), and returns :class:`Limits`.
The worker pool, the cost model and the policy are built once from them
(``specserve/coordinator/server.py``); nothing is patched afterwards.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from specserve.api import errors
from specserve.api.params import PROPOSER_KINDS
from specserve.coordinator.fleet.clients import WorkerClients, WorkerInfo
from specserve.engine.models import check_same_vocabulary
from specserve.runtime.config import CoordinatorSettings

log = structlog.get_logger(__name__)

#: How long start-up waits for each worker's info before going on without it.
INFO_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Limits:
    """What every reachable worker and the settings allow together."""

    vocab_size: int  # the target's output rows (the tokenizer's size when no target answered)
    max_gamma: int  # settings.max_gamma, lowered to every answering worker's max_gamma
    max_batch_size: int  # Verify items per call: settings.max_batch_size, lowered to every answering target's
    draft_max_batch_size: int = 1  # ProposeBatch items per call: settings.draft_max_batch_size, lowered to every
    # answering draft's max_batch_size (a draft that reports none takes one at a time)
    context_tokens: int | None = None  # the smallest context (max_positions) of every answering worker
    verify_curve_ns: tuple[float, ...] = ()  # per k positions, the median of the answering targets' curves
    #: Whether every answering draft serves the feature head (PROPOSER_KIND_FEATURE).
    feature_head: bool = False


async def _infos(clients: Mapping[str, Any]) -> dict[str, WorkerInfo]:
    async def one(ep: str, client: Any) -> tuple[str, WorkerInfo | None]:
        try:
            return ep, await client.info(timeout_s=INFO_TIMEOUT_S)
        except errors.SpecServeError as exc:
            log.warning("worker_info_unavailable", endpoint=ep, error=exc.message)
            return ep, None

    pairs = await asyncio.gather(*(one(ep, c) for ep, c in clients.items()))
    return {ep: info for ep, info in pairs if info is not None}


async def probe_limits(settings: CoordinatorSettings, clients: WorkerClients, tokenizer: Any) -> Limits:
    """Ask the workers for their limits; raises VocabularyMismatch for a worker or tokenizer that does not fit."""
    targets = await _infos(clients.targets)
    drafts = await _infos(clients.drafts)
    max_gamma = settings.max_gamma
    max_batch_size = settings.max_batch_size
    vocab_size = len(tokenizer)
    if targets:
        first = next(iter(targets.values()))
        vocab_size = first.model.vocab_size
        max_gamma = min(max_gamma, *(i.max_gamma for i in targets.values()))
        for info in (*targets.values(), *drafts.values()):
            check_same_vocabulary(info.model, first.model)
        max_batch_size = min(max_batch_size, *(i.max_batch_size or max_batch_size for i in targets.values()))
    else:
        log.warning("no_target_reachable_at_start", endpoints=settings.target_endpoints)
    draft_max_batch_size = settings.draft_max_batch_size
    if drafts:
        max_gamma = min(max_gamma, *(i.max_gamma for i in drafts.values()))
        draft_max_batch_size = min(draft_max_batch_size, *(i.max_batch_size or 1 for i in drafts.values()))
    if len(tokenizer) > vocab_size:
        raise errors.VocabularyMismatch(
            f"the coordinator's tokenizer has {len(tokenizer)} tokens but the target's vocabulary only {vocab_size}; "
            "point `tokenizer` at the target model's directory"
        )
    check_features(targets, drafts)
    contexts = [i.model.max_positions for i in (*targets.values(), *drafts.values()) if i.model.max_positions]
    return Limits(
        vocab_size=vocab_size,
        max_gamma=max_gamma,
        max_batch_size=max_batch_size,
        draft_max_batch_size=draft_max_batch_size,
        context_tokens=min(contexts) if contexts else None,
        verify_curve_ns=median_curve([i.verify_curve_ns for i in targets.values()]),
        feature_head=bool(drafts)
        and all(PROPOSER_KINDS["feature"] in i.proposers for i in drafts.values()),
    )


def check_features(targets: Mapping[str, WorkerInfo], drafts: Mapping[str, WorkerInfo]) -> None:
    """Raise :class:`~specserve.api.errors.FailedPrecondition` where a draft's feature head reads another
    feature than a target returns (a fused head beside a target that ships the last layer's, another width,
    another head's projection): its drafts would read garbage."""
    for draft_ep, draft in drafts.items():
        for target_ep, target in targets.items():
            if draft.feature and target.feature != draft.feature:
                raise errors.FailedPrecondition(
                    f"the feature head of the draft {draft_ep} reads the feature '{draft.feature}' but the target "
                    f"{target_ep} returns '{target.feature or 'one it does not name'}': start the target with "
                    "feature_head naming the head the draft serves (--feature-head, docs/design.md, 'The feature head')"
                )


def median_curve(curves: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per number of positions, the median of the curves that measured it (as long as the shortest one)."""
    measured = [c for c in curves if c]
    if not measured:
        return ()
    n = min(len(c) for c in measured)
    return tuple(float(statistics.median(c[k] for c in measured)) for k in range(n))
