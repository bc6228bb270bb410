"""The target's domain requests and results: what the verifier takes and returns.

They hold no wire: :mod:`specserve.target.servicer` converts a ``VerifyRequest``
to a :class:`VerifyBatch` (``batch_from_pb``) and a :class:`BatchResult` back
(``response_pb``). A batch is checked as it is converted, before any work. Each
item has its own fate: a malformed item (a bad id, a broken draft distribution,
a second item of the same session) is refused alone with an :class:`ItemResult`
carrying an :class:`~specserve.api.errors.InvalidArgument` that says what to fix,
and the other items are verified as if it were absent (:attr:`VerifyBatch.refused`).
Only a request that is wrong as a whole fails whole: no items
(INVALID_ARGUMENT), more than ``max_batch_size`` (RESOURCE_EXHAUSTED). Problems
with a session's *state* (unknown, stale version, finished) are found later, per
item, in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.api.errors import SpecServeError
from specserve.api.params import SessionBase, Verdict
from specserve.core.features import FeatureBlock
from specserve.core.proposal import DraftProposal
from specserve.core.tree import DraftTree

#: Most target steps one item may ask for in a call (``VerifyItem.decode_steps``): a call holds
#: its batch's other items and the model thread for this many passes.
MAX_DECODE_STEPS = 16


@dataclass(frozen=True)
class ItemToVerify:
    """One session's proposal after its committed prefix ``base``."""

    base: SessionBase
    proposal: DraftProposal
    #: Report the committed tokens' log probabilities with this many alternatives each (None: none).
    top_logprobs: int | None = None
    #: Target steps to take in this call: the first verifies the proposal (if any), each later one commits what
    #: a gamma = 0 round would.
    decode_steps: int = 1
    #: Return the target's features of committed positions from here on (None: none; docs/design.md,
    #: "The feature head").
    features_from: int | None = None
    #: With features_from: start at the last block of this call's prefix-cache hit, when that is later.
    features_from_uncached: bool = False
    #: With features_from: most bytes of features for the item (whole rows, at least one); 0: no own limit.
    features_max_bytes: int = 0
    #: The session's prefix-cache scope: its cache attaches and shares blocks of this scope only.
    cache_scope: bytes = b""
    #: The proposal as a draft tree (its tokens and q are the proposal's); None: a chain, the proposal itself.
    tree: DraftTree | None = None

    @property
    def session_id(self) -> str:
        return self.base.session_id

    @property
    def gamma(self) -> int:
        """Proposed tokens: a chain's length, a tree's nodes."""
        return len(self.proposal.token_ids)

    @property
    def depth(self) -> int:
        """Positions past the committed prefix the proposal reaches: a chain's gamma, a tree's levels."""
        return self.gamma if self.tree is None else self.tree.max_depth


@dataclass(frozen=True)
class VerifyBatch:
    """Proposals of distinct sessions, verified in one forward pass.

    ``items`` are the well-formed items in request order; ``refused`` the
    results of the malformed ones, by their index in the request.
    """

    items: tuple[ItemToVerify, ...]
    refused: tuple[tuple[int, ItemResult], ...] = ()

    def in_request_order(self, results: Sequence[ItemResult]) -> tuple[ItemResult, ...]:
        """``results`` (one per item of :attr:`items`) with the refused items put back in their places."""
        if len(results) != len(self.items):
            raise ValueError(f"{len(results)} results for {len(self.items)} items")
        ordered: list[ItemResult] = []
        pending = iter(results)
        refused = dict(self.refused)
        for index in range(len(self.items) + len(self.refused)):
            ordered.append(refused[index] if index in refused else next(pending))
        return tuple(ordered)


@dataclass(frozen=True)
class ItemResult:
    """The outcome for one item: a committed (or replayed) verdict, or why nothing was committed."""

    session_id: str
    verdict: Verdict | None = None
    error: SpecServeError | None = None
    replayed: bool = False
    features: FeatureBlock | None = None  # what the item asked for (VerifyItem.features_from), when held
    cached_tokens: int = 0  # committed tokens taken from the prefix cache instead of fed (VerifyResult)

    def __post_init__(self) -> None:
        if (self.verdict is None) == (self.error is None):
            raise ValueError("an ItemResult holds exactly one of verdict and error")


@dataclass(frozen=True)
class BatchResult:
    """Results in request order, and what the call cost."""

    results: tuple[ItemResult, ...]
    verify_ns: int  # the whole call
    forward_ns: int  # model passes alone (prefill passes included)
    positions_processed: int  # real positions fed through the model
