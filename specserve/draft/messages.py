"""The draft's domain requests and results, and their wire forms (``from_pb`` / ``to_pb``).

:meth:`ProposeCall.from_pb` checks everything that can be checked without the
session's state and raises :class:`~specserve.api.errors.InvalidArgument` saying
what to fix, before any work (a history longer than ``max_tokens``, the
draft's context, is refused before its tokens are even looked at); the engine
then checks the state (does it know the committed tokens before
``start_position``?). :meth:`ProposeBatchCall.from_pb` does the same per item:
a bad item becomes that item's error, the call goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
from specserve.draft.proposers import Drafted
from specserve.v1 import common_pb2, draft_pb2


@dataclass(frozen=True)
class ProposeCall:
    """A checked ``ProposeRequest``."""

    base: SessionBase
    start_position: int
    token_ids: tuple[int, ...]  # committed tokens [start_position, base.committed_len)
    sampling: SamplingParams
    gamma: int
    proposer: int  # ProposerKind, UNSPECIFIED resolved to MODEL
    draft_top_k: int
    seed: int
    stop_token_ids: frozenset[int] = frozenset()  # drafting ends after one of these
    ignore_eos: bool = False  # ... and after the model's end-of-sequence tokens unless this is set
    min_confidence: float = 0.0  # the proposal ends after a token drafted with probability below this
    features: FeatureBlock | None = None  # the target's features the draft has not seen (feature proposer)
    features_reset: bool = False  # ... which start a fresh context
    stop_tokens_from: int = 0  # min_new_tokens: stop tokens masked for tokens drafted before this position
    prompt_len: int = 0  # the session's prompt length (a constraint applies after it); 0: not sent
    cache_scope: bytes = b""  # the session's prefix-cache scope: its cache attaches and shares blocks of it only

    @property
    def session_id(self) -> str:
        return self.base.session_id

    @classmethod
    def from_pb(
        cls, pb: draft_pb2.ProposeRequest, *, vocab_size: int, max_gamma: int, max_tokens: int
    ) -> ProposeCall:
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
        return cls(
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
        )


@dataclass(frozen=True, eq=False)
class ProposeResult:
    """A proposal with its cost."""

    drafted: Drafted
    draft_ns: int

    def to_pb(self) -> draft_pb2.ProposeResponse:
        d = self.drafted
        proposal = common_pb2.Proposal(token_ids=list(d.token_ids))
        if d.probs_f32 is not None and d.token_ids:
            proposal.distributions.extend(draft_probs_to_pb(d.probs_f32, sparse=d.sparse))
        reply = draft_pb2.ProposeResponse(proposal=proposal, draft_ns=self.draft_ns, prefill_tokens=d.prefill_tokens)
        if d.features_needed_from is not None:
            reply.features_needed_from = d.features_needed_from
        return reply


@dataclass(frozen=True)
class ProposeBatchCall:
    """A ``ProposeBatchRequest``: each item checked on its own (a bad item is that item's error)."""

    items: tuple[ProposeCall | SpecServeError, ...]

    @classmethod
    def from_pb(
        cls,
        pb: draft_pb2.ProposeBatchRequest,
        *,
        vocab_size: int,
        max_gamma: int,
        max_batch_size: int,
        max_tokens: int,
    ) -> ProposeBatchCall:
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
                call = ProposeCall.from_pb(
                    item, vocab_size=vocab_size, max_gamma=max_gamma, max_tokens=max_tokens
                )
                if call.session_id in seen:
                    raise InvalidArgument(
                        f"item {index}: session {call.session_id!r} appears twice in one call"
                    )
                seen.add(call.session_id)
                items.append(call)
            except InvalidArgument as exc:
                items.append(exc)
        return cls(items=tuple(items))

    @property
    def calls(self) -> list[ProposeCall]:
        """The well-formed items, in order."""
        return [i for i in self.items if isinstance(i, ProposeCall)]


@dataclass(frozen=True, eq=False)
class ProposeBatchResult:
    """One outcome per item of a :class:`ProposeBatchCall`, in order, and the call's time."""

    outcomes: tuple[ProposeResult | SpecServeError, ...]
    draft_ns: int

    @classmethod
    def merge(
        cls, call: ProposeBatchCall, drafted: Sequence[ProposeResult | SpecServeError], draft_ns: int
    ) -> ProposeBatchResult:
        """The outcomes of ``call``'s items: its refused items' errors, the rest from ``drafted`` (for ``call.calls``)."""
        rest = iter(drafted)
        outcomes = tuple(item if isinstance(item, SpecServeError) else next(rest) for item in call.items)
        return cls(outcomes=outcomes, draft_ns=draft_ns)

    def to_pb(self) -> draft_pb2.ProposeBatchResponse:
        reply = draft_pb2.ProposeBatchResponse(draft_ns=self.draft_ns)
        for outcome in self.outcomes:
            if isinstance(outcome, SpecServeError):
                error = draft_pb2.ProposeError(code=item_code(outcome), message=outcome.message)
                reply.results.append(draft_pb2.ProposeBatchResult(error=error))
            else:
                reply.results.append(draft_pb2.ProposeBatchResult(proposal=outcome.to_pb()))
        return reply
