"""The draft replica's domain object: one Propose = resolve ``C``, pick the proposer, draft.

:class:`DraftEngine` holds the :class:`~draft_service.history.CommittedHistory`
(what this replica knows of each session's committed tokens) and one
:class:`~draft_service.proposers.Proposer` per ``ProposerKind``. Its methods are
synchronous and touch the model: the servicer runs them on one worker thread,
so they never run concurrently (the KV-cache store is not thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import structlog

from draft_service.history import CommittedHistory
from draft_service.messages import ProposeCall, ProposeResult
from draft_service.proposers import Drafted, DraftRequest, Proposer
from specserve.errors import FailedPrecondition, NotFound
from specserve.v1 import common_pb2

log = structlog.get_logger(__name__)


class DraftEngine:
    """Proposes tokens for many sessions; see the module docstring."""

    def __init__(self, proposers: Mapping[int, Proposer], history: CommittedHistory) -> None:
        self.proposers = dict(proposers)
        self.history = history

    def propose(self, call: ProposeCall) -> ProposeResult:
        start = time.perf_counter_ns()
        proposer = self.proposers.get(call.proposer)
        if proposer is None:
            name = common_pb2.ProposerKind.Name(call.proposer)
            raise FailedPrecondition(f"this draft server has no {name} proposer; use one of {self._kinds()}")
        committed = self.history.resolve(call.session_id, call.start_position, call.token_ids)
        for dropped in self.history.record(call.session_id, committed):
            self._release_everywhere(dropped)
        if call.gamma == 0:
            drafted = Drafted(token_ids=(), probs_f32=None)
        else:
            drafted = proposer.propose(
                DraftRequest(
                    session_id=call.session_id,
                    committed=committed,
                    gamma=call.gamma,
                    sampling=call.sampling,
                    seed=call.seed,
                    draft_top_k=call.draft_top_k,
                )
            )
        elapsed = time.perf_counter_ns() - start
        log.debug(
            "proposed",
            session_id=call.session_id,
            committed_len=len(committed),
            gamma=call.gamma,
            proposed=len(drafted.token_ids),
            prefill_tokens=drafted.prefill_tokens,
            draft_ns=elapsed,
        )
        return ProposeResult(drafted=drafted, draft_ns=elapsed)

    def release(self, session_id: str) -> None:
        """Drop everything held for the session; :class:`NotFound` when nothing was."""
        known = session_id in self.history
        if known:
            self.history.release(session_id)
        held = self._release_everywhere(session_id)
        if not (known or held):
            raise NotFound(
                f"session {session_id!r} is not known to this draft (never seen, released or expired)"
            )
        log.info("session_released", session_id=session_id, reason="request")

    def _release_everywhere(self, session_id: str) -> bool:
        return any([p.release(session_id) for p in self.proposers.values()])

    def _kinds(self) -> list[str]:
        return [common_pb2.ProposerKind.Name(k) for k in self.proposers]
