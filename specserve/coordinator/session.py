"""One generation session as the coordinator tracks it: committed tokens, version, stats.

The committed prefix has one mutator, :meth:`Session.advance`, which takes the
log from version ``v`` to a later version and returns exactly the tokens that
were not emitted before; callers stream those and nothing else, so what a
client receives is the committed log after the prompt, in order, each token
once (docs/design.md, invariant 4), whether the tokens came from a fresh verdict, a
replayed one, or a re-read of the log after a conflict.

``advance`` also hands every newly committed token to the session's followers
(:meth:`Session.follow`: its speculator, whose sources draft from them), so they
follow the committed prefix exactly.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specserve.api.errors import FailedPrecondition
from specserve.api.params import NOT_FINISHED, SamplingParams, SessionBase, StopConditions, Verdict
from specserve.coordinator.requests import SpeculationSettings


class SessionStatus(enum.IntEnum):
    """Ordered: a session only moves forward."""

    RUNNING = 1
    FINISHED = 2
    CANCELLED = 3
    FAILED = 4


@dataclass
class SourceStats:
    """One proposal source's share of a session's rounds."""

    draft_rounds: int = 0  # rounds it drafted (proposed at least one token)
    proposed_tokens: int = 0
    accepted_tokens: int = 0


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
    #: Prompt tokens the target did not prefill (its prefix cache held them), from the session's first verdict.
    cached_tokens: int = 0
    #: Per source of the session (every one, in order), what it drafted.
    sources: dict[str, SourceStats] = field(default_factory=dict)
    #: Predicted Outputs (the prediction source counts them): completion tokens predicted at their place, and
    #: tokens drafted from the prediction that were not committed.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def observe_round(
        self, *, proposed: int, accepted: int, source: str = "", levels: int | None = None
    ) -> None:
        """One round: ``proposed`` draft tokens (a tree's nodes), ``accepted`` of them accepted (a tree's accepted
        path), drafted by ``source``; ``levels``: the positions past the prefix they reach (None: ``proposed``,
        a chain), by which ``accepted_per_position`` counts."""
        self.rounds += 1
        if proposed:
            self.draft_rounds += 1
            row = self.sources.setdefault(source, SourceStats())
            row.draft_rounds += 1
            row.proposed_tokens += proposed
            row.accepted_tokens += accepted
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        levels = proposed if levels is None else levels
        if len(self.accepted_per_position) < levels:
            self.accepted_per_position.extend([0] * (levels - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def source(self, name: str) -> SourceStats:
        """``name``'s row (zeros where the session has no such source)."""
        return self.sources.get(name) or SourceStats()


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
        cache_scope: bytes = b"",
    ) -> None:
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
        self.start_ns = time.perf_counter_ns() if start_ns is None else start_ns
        self.status = SessionStatus.RUNNING
        self.finish_reason: int = NOT_FINISHED
        self.stats = SessionStats()
        #: Committed tokens [0, draft_seen) were sent to ``draft_endpoint``.
        self.draft_seen = 0
        self.draft_endpoint: str | None = None
        self._tokens: list[int] = list(prompt_token_ids)
        self._version = 0
        self._followers: list[Callable[[Sequence[int]], None]] = []

    def follow(self, observe: Callable[[Sequence[int]], None]) -> None:
        """Call ``observe`` with the tokens of every later commit, in order."""
        self._followers.append(observe)

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
        return self.finish_reason != NOT_FINISHED

    def unseen_by_draft(self, endpoint: str) -> tuple[int, tuple[int, ...]]:
        """``(start_position, token_ids)`` the draft at ``endpoint`` has not been sent yet."""
        start = self.draft_seen if endpoint == self.draft_endpoint else 0
        return start, tuple(self._tokens[start:])

    def draft_caught_up(self, endpoint: str) -> None:
        self.draft_endpoint = endpoint
        self.draft_seen = len(self._tokens)

    def draft_lost(self) -> None:
        """The draft failed: whichever draft serves the next round is sent every token."""
        self.draft_endpoint = None

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
        for observe in self._followers:
            observe(new)
        if finish_reason != NOT_FINISHED:
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
