"""The draft's domain request and result, and their wire forms (``from_pb`` / ``to_pb``).

:meth:`ProposeCall.from_pb` checks everything that can be checked without the
session's state and raises :class:`~specserve.errors.InvalidArgument` saying
what to fix, before any work; the engine then checks the state (does it know
the committed tokens before ``start_position``?).
"""

from __future__ import annotations

from dataclasses import dataclass

from draft_service.proposers import Drafted
from specserve.errors import InvalidArgument
from specserve.params import SamplingParams, SessionBase
from specserve.v1 import common_pb2, draft_pb2
from specserve.verification import draft_probs_to_pb

_KINDS = {
    common_pb2.PROPOSER_KIND_UNSPECIFIED: common_pb2.PROPOSER_KIND_MODEL,
    common_pb2.PROPOSER_KIND_MODEL: common_pb2.PROPOSER_KIND_MODEL,
    common_pb2.PROPOSER_KIND_NGRAM: common_pb2.PROPOSER_KIND_NGRAM,
}


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

    @property
    def session_id(self) -> str:
        return self.base.session_id

    @classmethod
    def from_pb(cls, pb: draft_pb2.ProposeRequest, *, vocab_size: int, max_gamma: int) -> ProposeCall:
        if not pb.HasField("base"):
            raise InvalidArgument("base (the session's committed prefix) is required")
        base = SessionBase.from_pb(pb.base)
        if base.committed_len < 1:
            raise InvalidArgument("base.committed_len must be >= 1 (a session holds at least its prompt)")
        if pb.gamma > max_gamma:
            raise InvalidArgument(f"gamma={pb.gamma} is above this draft server's max_gamma={max_gamma}")
        if pb.start_position + len(pb.token_ids) != base.committed_len:
            raise InvalidArgument(
                f"start_position ({pb.start_position}) + len(token_ids) ({len(pb.token_ids)}) must equal "
                f"base.committed_len ({base.committed_len}): send the committed tokens from start_position on"
            )
        bad = [t for t in pb.token_ids if t >= vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is out of range; ids must be in [0, {vocab_size})")
        if pb.proposer not in _KINDS:
            raise InvalidArgument(f"unknown proposer kind {pb.proposer}; use MODEL or NGRAM")
        if pb.draft_top_k > vocab_size:
            raise InvalidArgument(
                f"draft_top_k={pb.draft_top_k} exceeds the vocabulary size {vocab_size}; use 0 (off) or less"
            )
        return cls(
            base=base,
            start_position=pb.start_position,
            token_ids=tuple(int(t) for t in pb.token_ids),
            sampling=SamplingParams.from_pb(pb.sampling, default_seed=pb.seed),
            gamma=pb.gamma,
            proposer=_KINDS[pb.proposer],
            draft_top_k=pb.draft_top_k,
            seed=pb.seed,
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
        return draft_pb2.ProposeResponse(
            proposal=proposal, draft_ns=self.draft_ns, prefill_tokens=d.prefill_tokens
        )
