"""The target's domain requests and results, and their wire forms (``from_pb`` / ``to_pb``).

A :class:`VerifyBatch` is checked on construction from the wire
(:meth:`VerifyBatch.from_pb`), before any work. Each item has its own fate: a
malformed item (a bad id, a broken draft distribution, a second item of the
same session) is refused alone with an :class:`ItemResult` carrying an
:class:`~specserve.api.errors.InvalidArgument` that says what to fix, and the other
items are verified as if it were absent. Only a request that is wrong as a
whole fails whole: no items (INVALID_ARGUMENT), more than ``max_batch_size``
(RESOURCE_EXHAUSTED). Problems with a session's *state* (unknown, stale
version, finished) are found later, per item, in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.api.errors import InvalidArgument, ResourceExhausted, SpecServeError, ZeroDraftProbability
from specserve.api.params import SessionBase, Verdict, check_cache_scope, check_top_logprobs
from specserve.api.status import item_code
from specserve.core.features import FeatureBlock
from specserve.core.proposal import DraftProposal, draft_probs_from_pb
from specserve.core.tree import MAX_TREE_NODES, DraftTree
from specserve.v1 import target_pb2

#: Most target steps one gamma = 0 item may ask for in a call (``VerifyItem.decode_steps``): a call holds
#: its batch's other items and the model thread for this many passes.
MAX_DECODE_STEPS = 16


@dataclass(frozen=True)
class ItemToVerify:
    """One session's proposal after its committed prefix ``base``."""

    base: SessionBase
    proposal: DraftProposal
    #: Report the committed tokens' log probabilities with this many alternatives each (None: none).
    top_logprobs: int | None = None
    #: Target steps to decode in this call (gamma = 0 only): each commits what a gamma = 0 round would.
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

    @classmethod
    def from_pb(
        cls, pb: target_pb2.VerifyRequest, *, vocab_size: int, max_gamma: int, max_batch_size: int
    ) -> VerifyBatch:
        """Check and convert a request before any work: malformed items are refused one by one."""
        if not pb.items:
            raise InvalidArgument("a Verify request needs at least one item")
        if len(pb.items) > max_batch_size:
            raise ResourceExhausted(
                f"{len(pb.items)} items in one Verify call; this server takes at most {max_batch_size}"
            )
        items: list[ItemToVerify] = []
        refused: list[tuple[int, ItemResult]] = []
        seen: set[str] = set()
        for index, item in enumerate(pb.items):
            try:
                verify_item = _item_from_pb(item, vocab_size=vocab_size, max_gamma=max_gamma)
                if verify_item.session_id in seen:
                    raise InvalidArgument(
                        f"session {verify_item.session_id!r} appears twice in one Verify call"
                    )
            except InvalidArgument as exc:
                error = type(exc)(f"item {index}: {exc.message}")
                refused.append((index, ItemResult(item.base.session_id, error=error)))
                continue
            seen.add(verify_item.session_id)
            items.append(verify_item)
        return cls(items=tuple(items), refused=tuple(refused))

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


def _item_from_pb(pb: target_pb2.ItemToVerify, *, vocab_size: int, max_gamma: int) -> ItemToVerify:
    if not pb.HasField("base"):
        raise InvalidArgument("base (the session's committed prefix) is required")
    base = SessionBase.from_pb(pb.base)
    if base.committed_len < 1:
        raise InvalidArgument("base.committed_len must be >= 1 (a session holds at least its prompt)")
    token_ids = tuple(int(t) for t in pb.proposal.token_ids)
    parents = tuple(int(v) for v in pb.proposal.parents)
    if parents and parents == tuple(range(-1, len(token_ids) - 1)):
        parents = ()  # a chain sent as a tree: the chain's path
    if parents:
        _check_tree_shape(token_ids, parents, max_gamma=max_gamma)
    elif len(token_ids) > max_gamma:
        raise InvalidArgument(f"{len(token_ids)} proposed tokens; this server verifies at most {max_gamma}")
    for t in token_ids:
        if t >= vocab_size:
            raise InvalidArgument(f"proposed token id {t} is out of range; ids must be in [0, {vocab_size})")
    n_dist = len(pb.proposal.distributions)
    if n_dist not in (0, len(token_ids)):
        raise InvalidArgument(
            f"{n_dist} draft distributions for {len(token_ids)} proposed tokens; send one per token, "
            "or none for a point-mass (greedy or n-gram) proposal"
        )
    probs = None
    if n_dist:
        probs = draft_probs_from_pb(pb.proposal.distributions, vocab_size)  # [gamma, vocab] float64
        for i, t in enumerate(token_ids):
            if not probs[i, t] > 0:
                raise ZeroDraftProbability(
                    f"proposed token {t} at index {i} has probability 0 under the distribution sent with it"
                )
    top_logprobs = check_top_logprobs(pb.logprobs.top_logprobs) if pb.HasField("logprobs") else None
    steps = max(1, pb.decode_steps)
    if steps > 1 and token_ids:
        raise InvalidArgument(
            f"decode_steps={steps} with {len(token_ids)} proposed tokens; several target steps in one call "
            "are for gamma = 0 items only (send an empty proposal, or decode_steps <= 1)"
        )
    if steps > MAX_DECODE_STEPS:
        raise InvalidArgument(f"decode_steps={steps}; this server decodes at most {MAX_DECODE_STEPS} per call")
    features_from = pb.features_from if pb.HasField("features_from") else None
    if features_from is not None and features_from > base.committed_len - 1:
        raise InvalidArgument(
            f"features_from={features_from}: features start at a committed position before the last "
            f"committed token ({base.committed_len - 1}) at most"
        )
    proposal = DraftProposal(token_ids=token_ids, probs=probs)
    return ItemToVerify(
        base=base,
        proposal=proposal,
        tree=DraftTree(token_ids, parents, probs) if parents else None,
        top_logprobs=top_logprobs,
        decode_steps=steps,
        features_from=features_from,
        features_from_uncached=pb.features_from_uncached,
        features_max_bytes=pb.features_max_bytes,
        cache_scope=check_cache_scope(pb.cache_scope),
    )


def _check_tree_shape(token_ids: tuple[int, ...], parents: tuple[int, ...], *, max_gamma: int) -> None:
    """A draft tree's bounds, before anything is decoded: one parent per token, at most
    :data:`~specserve.core.tree.MAX_TREE_NODES` nodes and ``max_gamma`` levels (the rest is
    :class:`~specserve.core.tree.DraftTree`'s check)."""
    if len(parents) != len(token_ids):
        raise InvalidArgument(
            f"{len(parents)} parents for {len(token_ids)} proposed tokens; a draft tree sends one parent per token "
            "(none for a chain)"
        )
    if len(token_ids) > MAX_TREE_NODES:
        raise InvalidArgument(
            f"a draft tree of {len(token_ids)} nodes; this server verifies at most {MAX_TREE_NODES}"
        )
    depth = DraftTree(token_ids, parents).max_depth
    if depth > max_gamma:
        raise InvalidArgument(f"a draft tree {depth} levels deep; this server verifies at most {max_gamma}")


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

    def to_pb(self) -> target_pb2.VerifyResult:
        pb = target_pb2.VerifyResult(
            session_id=self.session_id, replayed=self.replayed, cached_tokens=self.cached_tokens
        )
        if self.verdict is not None:
            pb.verdict.CopyFrom(self.verdict.to_pb())
            if self.features is not None:
                pb.features.CopyFrom(self.features.to_pb())
        else:
            assert self.error is not None
            pb.error.CopyFrom(target_pb2.ItemError(code=item_code(self.error), message=self.error.message))
        return pb


@dataclass(frozen=True)
class BatchResult:
    """Results in request order, and what the call cost."""

    results: tuple[ItemResult, ...]
    verify_ns: int  # the whole call
    forward_ns: int  # model passes alone (prefill passes included)
    positions_processed: int  # real positions fed through the model

    def to_pb(self) -> target_pb2.VerifyResponse:
        return target_pb2.VerifyResponse(
            results=[r.to_pb() for r in self.results],
            verify_ns=self.verify_ns,
            forward_ns=self.forward_ns,
            positions_processed=self.positions_processed,
        )
