"""The TargetService gRPC servicer: wire message -> domain object -> one domain call -> reply.

No tensor maths here (docs/design.md, "Conventions": thin servicers), and the target's edge with the wire:
:func:`batch_from_pb` checks a ``VerifyRequest`` and converts it to a
:class:`~specserve.target.messages.VerifyBatch` (a malformed item refused alone, see
:mod:`specserve.target.messages`), :class:`~specserve.target.verifier.Verifier` does the work, and
:func:`response_pb` converts its :class:`~specserve.target.messages.BatchResult` back, here only. Domain
errors propagate to :class:`specserve.runtime.server.ErrorInterceptor`, which maps them
to status codes.
"""

from __future__ import annotations

import grpc

from specserve.api.errors import InvalidArgument, ResourceExhausted, ZeroDraftProbability
from specserve.api.params import SessionBase, check_cache_scope, check_top_logprobs
from specserve.api.status import item_code
from specserve.core.proposal import DraftProposal, draft_probs_from_pb
from specserve.core.tree import MAX_TREE_NODES, DraftTree
from specserve.engine.models import LoadedModel
from specserve.runtime import metrics
from specserve.target.messages import MAX_DECODE_STEPS, BatchResult, ItemResult, ItemToVerify, VerifyBatch
from specserve.target.verifier import Verifier
from specserve.v1 import target_pb2, target_pb2_grpc


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Hosts one :class:`Verifier`; limits come from the server's settings."""

    def __init__(
        self, verifier: Verifier, model: LoadedModel, *, max_gamma: int, max_batch_size: int
    ) -> None:
        self.verifier = verifier
        self.model = model
        self.max_gamma = max_gamma
        self.max_batch_size = max_batch_size

    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        batch = batch_from_pb(
            request,
            vocab_size=self.model.vocab_size,
            max_gamma=self.max_gamma,
            max_batch_size=self.max_batch_size,
        )
        metrics.TARGET_BATCH_OCCUPANCY.set(len(batch.items) / self.max_batch_size)
        with metrics.TARGET_INFLIGHT.track_inprogress():
            result = await self.verifier.verify(batch)
        return response_pb(result)

    async def ReleaseTargetSession(
        self, request: target_pb2.ReleaseTargetSessionRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ReleaseTargetSessionResponse:
        await self.verifier.release(request.session_id)
        return target_pb2.ReleaseTargetSessionResponse()

    async def GetTargetInfo(
        self, request: target_pb2.GetTargetInfoRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.GetTargetInfoResponse:
        return target_pb2.GetTargetInfoResponse(
            model=self.model.to_pb(),
            max_gamma=self.max_gamma,
            max_batch_size=self.max_batch_size,
            verify_curve_ns=self.verifier.verify_curve_ns,
            feature=self.verifier.caches.feature_maker.name,
        )


def batch_from_pb(
    pb: target_pb2.VerifyRequest, *, vocab_size: int, max_gamma: int, max_batch_size: int
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
                raise InvalidArgument(f"session {verify_item.session_id!r} appears twice in one Verify call")
        except InvalidArgument as exc:
            error = type(exc)(f"item {index}: {exc.message}")
            refused.append((index, ItemResult(item.base.session_id, error=error)))
            continue
        seen.add(verify_item.session_id)
        items.append(verify_item)
    return VerifyBatch(items=tuple(items), refused=tuple(refused))


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
    if steps > MAX_DECODE_STEPS:
        raise InvalidArgument(
            f"decode_steps={steps}; this server decodes at most {MAX_DECODE_STEPS} per call"
        )
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


def result_pb(item: ItemResult) -> target_pb2.VerifyResult:
    """One item's outcome on the wire: its verdict (with the features it asked for) or its error."""
    pb = target_pb2.VerifyResult(
        session_id=item.session_id, replayed=item.replayed, cached_tokens=item.cached_tokens
    )
    if item.verdict is not None:
        pb.verdict.CopyFrom(item.verdict.to_pb())
        if item.features is not None:
            pb.features.CopyFrom(item.features.to_pb())
    else:
        assert item.error is not None
        pb.error.CopyFrom(target_pb2.ItemError(code=item_code(item.error), message=item.error.message))
    return pb


def response_pb(result: BatchResult) -> target_pb2.VerifyResponse:
    """The reply to a Verify call: its results in request order and what the call cost."""
    return target_pb2.VerifyResponse(
        results=[result_pb(r) for r in result.results],
        verify_ns=result.verify_ns,
        forward_ns=result.forward_ns,
        positions_processed=result.positions_processed,
    )
