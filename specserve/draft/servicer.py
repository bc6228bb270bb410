"""The DraftService gRPC servicer: wire message -> domain object -> one domain call -> reply.

No tensor maths here (docs/design.md, "Conventions": thin servicers), and the draft's edge with the wire:
:func:`call_from_pb` / :func:`batch_call_from_pb` check a request and convert it to a
:class:`~specserve.draft.messages.ProposeCall` / :class:`~specserve.draft.messages.ProposeBatchCall`
(see :mod:`specserve.draft.messages` for what is checked where), :class:`~specserve.draft.engine.DraftEngine`
does the work (model work batched on its model thread), and :func:`proposal_pb` / :func:`batch_response_pb`
convert its :class:`~specserve.draft.messages.ProposeResult` / :class:`~specserve.draft.messages.ProposeBatchResult`
back, here only. Domain errors propagate to :class:`specserve.runtime.server.ErrorInterceptor`.
"""

from __future__ import annotations

import time

import grpc

from specserve.api.errors import InvalidArgument, ResourceExhausted, SpecServeError
from specserve.api.params import (
    SamplingParams,
    SessionBase,
    check_cache_scope,
    check_min_confidence,
    resolve_proposer,
)
from specserve.api.status import item_code
from specserve.core.features import FeatureBlock
from specserve.core.proposal import draft_probs_to_pb
from specserve.core.ranked_tree import TreeBudget
from specserve.draft.engine import DraftEngine
from specserve.draft.messages import ProposeBatchCall, ProposeBatchResult, ProposeCall, ProposeResult
from specserve.engine.models import ModelInfo
from specserve.runtime import metrics
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Hosts one :class:`DraftEngine` (whose model thread drafts what is queued, a batch at a time)."""

    def __init__(
        self, engine: DraftEngine, info: ModelInfo, *, max_gamma: int, max_tokens: int, feature: str = ""
    ) -> None:
        self.engine = engine
        self.info = info
        self.max_gamma = max_gamma
        self.max_tokens = max_tokens  # longest committed history a Propose may carry
        self.feature = feature  # the feature its head reads (FeatureHead.feature_name); "" without a head

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        call = call_from_pb(
            request, vocab_size=self.info.vocab_size, max_gamma=self.max_gamma, max_tokens=self.max_tokens
        )
        with metrics.DRAFT_SECONDS.time():
            result = await self.engine.propose(call)
        return proposal_pb(result)

    async def ProposeBatch(
        self, request: draft_pb2.ProposeBatchRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeBatchResponse:
        batch = batch_call_from_pb(
            request,
            vocab_size=self.info.vocab_size,
            max_gamma=self.max_gamma,
            max_batch_size=self.engine.max_batch_size,
            max_tokens=self.max_tokens,
        )
        start = time.perf_counter_ns()
        with metrics.DRAFT_SECONDS.time():
            drafted = await self.engine.propose_batch(batch.calls)
        return batch_response_pb(ProposeBatchResult.merge(batch, drafted, time.perf_counter_ns() - start))

    async def ReleaseDraftSession(
        self, request: draft_pb2.ReleaseDraftSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ReleaseDraftSessionResponse:
        await self.engine.release(request.session_id)
        return draft_pb2.ReleaseDraftSessionResponse()

    async def GetDraftInfo(
        self, request: draft_pb2.GetDraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.GetDraftInfoResponse:
        return draft_pb2.GetDraftInfoResponse(
            model=self.info.to_pb(),
            max_gamma=self.max_gamma,
            max_batch_size=self.engine.max_batch_size,
            proposers=sorted(self.engine.proposers),
            feature=self.feature,
        )


def call_from_pb(
    pb: draft_pb2.ProposeRequest, *, vocab_size: int, max_gamma: int, max_tokens: int
) -> ProposeCall:
    """Check and convert a ``ProposeRequest`` before any work: what can be checked without the session's state."""
    if not pb.HasField("base"):
        raise InvalidArgument("base (the session's committed prefix) is required")
    base = SessionBase.from_pb(pb.base)
    if base.committed_len < 1:
        raise InvalidArgument("base.committed_len must be >= 1 (a session holds at least its prompt)")
    if base.committed_len > max_tokens or len(pb.token_ids) > max_tokens:
        raise InvalidArgument(
            f"the session holds {max(base.committed_len, len(pb.token_ids))} committed tokens; this draft "
            f"takes sessions of at most {max_tokens} tokens (its context)"
        )
    if pb.gamma > max_gamma:
        raise InvalidArgument(f"gamma={pb.gamma} is above this draft server's max_gamma={max_gamma}")
    if pb.start_position + len(pb.token_ids) != base.committed_len:
        raise InvalidArgument(
            f"start_position ({pb.start_position}) + len(token_ids) ({len(pb.token_ids)}) must equal "
            f"base.committed_len ({base.committed_len}): send the committed tokens from start_position on"
        )
    bad = [t for t in (*pb.token_ids, *pb.stop_token_ids) if t >= vocab_size]
    if bad:
        raise InvalidArgument(f"token id {bad[0]} is out of range; ids must be in [0, {vocab_size})")
    proposer = resolve_proposer(pb.proposer)
    if pb.draft_top_k > vocab_size:
        raise InvalidArgument(
            f"draft_top_k={pb.draft_top_k} exceeds the vocabulary size {vocab_size}; use 0 (off) or less"
        )
    features = FeatureBlock.from_pb(pb.features) if pb.HasField("features") else None
    if features is not None and features.stop > base.committed_len - 1:
        raise InvalidArgument(
            f"features reach position {features.stop - 1}; send only positions before the last committed "
            f"token ({base.committed_len - 1})"
        )
    sampling = SamplingParams.from_pb(pb.sampling, default_seed=pb.seed)
    if sampling.constraint is not None and not 1 <= pb.prompt_len <= base.committed_len:
        raise InvalidArgument(
            f"prompt_len={pb.prompt_len} must be in [1, base.committed_len={base.committed_len}] with a "
            "constraint (it applies to the tokens after the prompt)"
        )
    tree = TreeBudget(pb.tree_max_nodes, pb.tree_min_path_probability, pb.tree_expand_min_path_probability)
    if sampling.constraint is not None and tree.branches:
        raise InvalidArgument(
            "a constrained session's proposal is a chain (its grammar masks walk a chain): send tree_max_nodes=0"
        )
    return ProposeCall(
        base=base,
        start_position=pb.start_position,
        token_ids=tuple(int(t) for t in pb.token_ids),
        sampling=sampling,
        gamma=pb.gamma,
        proposer=proposer,
        draft_top_k=pb.draft_top_k,
        seed=pb.seed,
        stop_token_ids=frozenset(int(t) for t in pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        min_confidence=check_min_confidence(pb.min_confidence),
        features=features,
        features_reset=pb.features_reset,
        stop_tokens_from=pb.stop_tokens_from,
        prompt_len=pb.prompt_len,
        cache_scope=check_cache_scope(pb.cache_scope),
        tree=tree,
    )


def batch_call_from_pb(
    pb: draft_pb2.ProposeBatchRequest,
    *,
    vocab_size: int,
    max_gamma: int,
    max_batch_size: int,
    max_tokens: int,
) -> ProposeBatchCall:
    """Check and convert a ``ProposeBatchRequest``: each item on its own, a bad item becomes that item's error."""
    if not pb.items:
        raise InvalidArgument("a ProposeBatch request needs at least one item")
    if len(pb.items) > max_batch_size:
        raise ResourceExhausted(
            f"{len(pb.items)} items in one ProposeBatch call; this server takes at most {max_batch_size}"
        )
    items: list[ProposeCall | SpecServeError] = []
    seen: set[str] = set()
    for index, item in enumerate(pb.items):
        try:
            call = call_from_pb(item, vocab_size=vocab_size, max_gamma=max_gamma, max_tokens=max_tokens)
            if call.session_id in seen:
                raise InvalidArgument(f"item {index}: session {call.session_id!r} appears twice in one call")
            seen.add(call.session_id)
            items.append(call)
        except InvalidArgument as exc:
            items.append(exc)
    return ProposeBatchCall(items=tuple(items))


def proposal_pb(result: ProposeResult) -> draft_pb2.ProposeResponse:
    """A proposal on the wire, with its cost."""
    d = result.drafted
    proposal = common_pb2.Proposal(token_ids=list(d.token_ids), parents=list(d.parents))
    if d.probs_f32 is not None and d.token_ids:
        proposal.distributions.extend(draft_probs_to_pb(d.probs_f32, sparse=d.sparse))
        for token in d.token_ids[d.probs_f32.shape[0] :]:  # a tree's alternatives: point masses
            point = common_pb2.SparseDistribution(token_ids=[token], probs=[1.0])
            proposal.distributions.append(common_pb2.DraftDistribution(sparse=point))
    reply = draft_pb2.ProposeResponse(
        proposal=proposal,
        draft_ns=result.draft_ns,
        prefill_tokens=d.prefill_tokens,
        expansion_passes=d.expansion_passes,
    )
    if d.features_needed_from is not None:
        reply.features_needed_from = d.features_needed_from
    return reply


def batch_response_pb(result: ProposeBatchResult) -> draft_pb2.ProposeBatchResponse:
    """The reply to a ProposeBatch call: one proposal or error per item, in order."""
    reply = draft_pb2.ProposeBatchResponse(draft_ns=result.draft_ns)
    for outcome in result.outcomes:
        if isinstance(outcome, SpecServeError):
            error = draft_pb2.ProposeError(code=item_code(outcome), message=outcome.message)
            reply.results.append(draft_pb2.ProposeBatchResult(error=error))
        else:
            reply.results.append(draft_pb2.ProposeBatchResult(proposal=proposal_pb(outcome)))
    return reply
