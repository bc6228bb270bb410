"""One generation session as the coordinator tracks it: committed tokens, version, stats.

The committed prefix has one mutator, :meth:`Session.advance`, which takes the
log from version ``v`` to a later version and returns exactly the tokens that
were not emitted before; callers stream those and nothing else, so what a
client receives is the committed log after the prompt, in order, each token
once (docs/design.md, invariant 4), whether the tokens came from a fresh verdict, a
replayed one, or a re-read of the log after a conflict.

A session also owns its proposers that need no model
(:mod:`specserve.coordinator.local_proposers`: the n-gram lookup when it drafts with
``ngram``, the prediction when the request carries one, and the *hybrid
lookup* of a session that drafts with the model under the adaptive policy):
``advance`` feeds them every newly committed token, so they follow the
committed prefix exactly.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.api.errors import FailedPrecondition
from specserve.api.params import SamplingParams, SessionBase, StopConditions, Verdict
from specserve.coordinator.feature_relay import DEFAULT_MAX_BYTES, FeatureRelay
from specserve.coordinator.local_proposers import LocalProposer, NgramProposer, PredictionProposer
from specserve.coordinator.requests import SpeculationSettings
from specserve.v1 import common_pb2, coordinator_pb2


class SessionStatus(enum.IntEnum):
    """Ordered: a session only moves forward."""

    RUNNING = 1
    FINISHED = 2
    CANCELLED = 3
    FAILED = 4


@dataclass
class SessionStats:
    """What GenerationStats reports, accumulated round by round."""

    rounds: int = 0
    #: Rounds that proposed at least one draft token (vLLM's ``num_drafts``).
    draft_rounds: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_ns: int = 0
    verify_ns: int = 0
    queue_ns: int = 0
    target_ns: int = 0  # the target's own account of the Verify calls
    forward_ns: int = 0  # the target's forward passes in those calls
    first_token_ns: int = 0
    #: Of the proposed and accepted tokens, those an n-gram lookup in the coordinator drafted.
    lookup_proposed_tokens: int = 0
    lookup_accepted_tokens: int = 0
    #: Prompt tokens the target did not prefill (its prefix cache held them), from the session's first verdict.
    cached_tokens: int = 0
    #: Of the proposed and accepted tokens, those a constrained session's forced text drafted.
    forced_proposed_tokens: int = 0
    forced_accepted_tokens: int = 0

    def observe_round(self, *, proposed: int, accepted: int, lookup: bool = False, forced: bool = False) -> None:
        """One round: ``proposed`` draft tokens, ``accepted`` of them accepted; ``lookup``: drafted by an
        n-gram lookup in the coordinator; ``forced``: drafted from the forced text."""
        self.rounds += 1
        if proposed:
            self.draft_rounds += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        if lookup:
            self.lookup_proposed_tokens += proposed
            self.lookup_accepted_tokens += accepted
        if forced:
            self.forced_proposed_tokens += proposed
            self.forced_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class Session:
    """A session's committed prefix (read-only views) plus what the draft has seen and the stats."""

    def __init__(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        stop: StopConditions,
        speculation: SpeculationSettings,
        *,
        start_ns: int | None = None,
        top_logprobs: int | None = None,
        prediction: Sequence[int] | None = None,
        lookup: bool = False,
        forced: LocalProposer | None = None,
        features_max_bytes: int = DEFAULT_MAX_BYTES,
        cache_scope: bytes = b"",
    ) -> None:
        """``lookup``: keep a hybrid lookup (:attr:`lookup`) beside the draft model; only for a session that
        drafts with the model and has no prediction (their proposers already run in the coordinator).
        ``forced``: a constrained session's forced-text proposer (:attr:`forced`). ``features_max_bytes``:
        most bytes of the target's features its relay keeps (a feature session's). ``cache_scope``: its
        prefix-cache scope (:attr:`cache_scope`)."""
        self.session_id = session_id
        #: Who may share this session's cached prefix (specserve/coordinator/cache_scope.py): sent with every Verify item
        #: and Propose, and part of its routing key.
        self.cache_scope = cache_scope
        self.prompt_len = len(prompt_token_ids)
        self.sampling = sampling
        self.stop = stop
        self.speculation = speculation
        #: Report every token's log probability with this many alternatives (None: no logprobs).
        self.top_logprobs = top_logprobs
        #: Predicted Outputs (None: the request has no prediction).
        self.prediction = PredictionProposer(prediction) if prediction else None
        ngram = (
            NgramProposer(prompt_token_ids) if speculation.proposer == common_pb2.PROPOSER_KIND_NGRAM else None
        )
        #: Proposers that run in the coordinator, asked in this order before the draft model.
        self.local_proposers: tuple[LocalProposer, ...] = tuple(
            p for p in (self.prediction, ngram) if p is not None
        )
        #: The hybrid lookup: an n-gram index over the session's tokens that the round loop drafts from
        #: instead of the model when the lookup's own acceptance makes that pay (specserve/coordinator/round.py).
        #: Not one of :attr:`local_proposers`: those are asked before the model every round.
        #: (A session with local proposers drafts with the ``ngram`` proposer or from a prediction.)
        self.lookup: NgramProposer | None = (
            NgramProposer(prompt_token_ids) if lookup and not self.local_proposers else None
        )
        #: A constrained session's forced text (``ForcedTextProposer``), which the round loop drafts from with
        #: no call where the grammar allows one continuation only; None: the session has no constraint.
        self.forced = forced
        #: The target's features on their way to the feature head (None: the session drafts with another proposer).
        self.features = (
            FeatureRelay(max_bytes=features_max_bytes)
            if speculation.proposer == common_pb2.PROPOSER_KIND_FEATURE
            else None
        )
        self.start_ns = time.perf_counter_ns() if start_ns is None else start_ns
        self.status = SessionStatus.RUNNING
        self.finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
        self.stats = SessionStats()
        #: Committed tokens [0, draft_seen) were sent to ``draft_endpoint``.
        self.draft_seen = 0
        self.draft_endpoint: str | None = None
        self._tokens: list[int] = list(prompt_token_ids)
        self._version = 0

    # ---- read-only views -------------------------------------------------
    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def committed_len(self) -> int:
        return len(self._tokens)

    @property
    def version(self) -> int:
        return self._version

    @property
    def generated_token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokens[self.prompt_len :])

    @property
    def base(self) -> SessionBase:
        return SessionBase(self.session_id, len(self._tokens), self._version)

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def unseen_by_draft(self, endpoint: str) -> tuple[int, tuple[int, ...]]:
        """``(start_position, token_ids)`` the draft at ``endpoint`` has not been sent yet."""
        start = self.draft_seen if endpoint == self.draft_endpoint else 0
        return start, tuple(self._tokens[start:])

    def draft_caught_up(self, endpoint: str) -> None:
        self.draft_endpoint = endpoint
        self.draft_seen = len(self._tokens)

    def draft_lost(self) -> None:
        """The draft failed: whichever draft serves the next round is sent every token (and the feature head's
        context again, from the features the relay keeps)."""
        self.draft_endpoint = None
        if self.features is not None:
            self.features.refused()

    # ---- the one mutator -------------------------------------------------
    def advance(
        self, log_tokens: Sequence[int], *, start: int, version: int, finish_reason: int
    ) -> tuple[int, ...]:
        """Move to ``version`` whose log holds ``log_tokens`` from index ``start`` on.

        Returns the tokens that are new to this session (to be emitted). The
        part of ``log_tokens`` this session already holds must agree with it;
        anything else is a broken log and raises FailedPrecondition.
        """
        if version < self._version:
            raise FailedPrecondition(
                f"session {self.session_id}: version went back from {self._version} to {version}"
            )
        if start > len(self._tokens):
            raise FailedPrecondition(
                f"session {self.session_id}: log segment starts at {start}, beyond the {len(self._tokens)} held"
            )
        overlap = self._tokens[start:]
        if tuple(log_tokens[: len(overlap)]) != tuple(overlap):
            raise FailedPrecondition(
                f"session {self.session_id}: the committed log disagrees with the stream"
            )
        new = tuple(log_tokens[len(overlap) :])
        if new and not self._tokens[self.prompt_len :] and self.stats.first_token_ns == 0:
            self.stats.first_token_ns = time.perf_counter_ns() - self.start_ns
        self._tokens.extend(new)
        self._version = version
        for proposer in self.local_proposers:
            proposer.observe(new)
        if self.lookup is not None:
            self.lookup.observe(new)
        if self.forced is not None:
            self.forced.observe(new)
        if finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = finish_reason
            self.status = SessionStatus.FINISHED
        return new

    def apply_verdict(self, verdict: Verdict) -> tuple[int, ...]:
        """Advance by one verdict (fresh or replayed) committed on top of this session's base."""
        start = verdict.committed_len - len(verdict.committed_token_ids)
        return self.advance(
            verdict.committed_token_ids,
            start=start,
            version=verdict.new_version,
            finish_reason=verdict.finish_reason,
        )

    def end(self, status: SessionStatus) -> None:
        if status > self.status:
            self.status = status

    # ---- wire ------------------------------------------------------------
    def stats_pb(self) -> coordinator_pb2.GenerationStats:
        s = self.stats
        return coordinator_pb2.GenerationStats(
            session_id=self.session_id,
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self._tokens) - self.prompt_len,
            rounds=s.rounds,
            proposed_tokens=s.proposed_tokens,
            accepted_tokens=s.accepted_tokens,
            accepted_per_position=s.accepted_per_position,
            draft_ns=s.draft_ns,
            verify_ns=s.verify_ns,
            queue_ns=s.queue_ns,
            target_ns=s.target_ns,
            forward_ns=s.forward_ns,
            lookup_proposed_tokens=s.lookup_proposed_tokens,
            lookup_accepted_tokens=s.lookup_accepted_tokens,
            cached_tokens=s.cached_tokens,
            forced_proposed_tokens=s.forced_proposed_tokens,
            forced_accepted_tokens=s.forced_accepted_tokens,
            proposer=self.speculation.proposer,
            first_token_ns=s.first_token_ns,
            total_ns=time.perf_counter_ns() - self.start_ns,
            finish_reason=self.finish_reason,
            seed=self.sampling.seed,
            draft_rounds=s.draft_rounds,
            accepted_prediction_tokens=self.prediction.accepted_tokens if self.prediction else 0,
            rejected_prediction_tokens=self.prediction.rejected_tokens if self.prediction else 0,
        )
