"""Overlap (``CoordinatorSettings.overlap``): while the target verifies a round drafted by the model, the
draft drafts the next one as if the whole proposal is accepted (docs/design.md).

One :class:`Overlap` per session. :meth:`Overlap.take` gives the round the proposal drafted ahead when it
was drafted for exactly the session's committed prefix (a resync makes it useless); :meth:`Overlap.start`
starts drafting ahead beside the round's verify; :meth:`Overlap.finish` keeps that draft for the next round
when the verdict bears its hypothesis out, and throws it away otherwise. A draft ahead never fails a round.
"""

from __future__ import annotations

import asyncio
import time

from specserve.api.params import Verdict
from specserve.coordinator.fleet.pool import Proposed, WorkerPool
from specserve.coordinator.session import Session
from specserve.runtime import metrics
from specserve.v1 import common_pb2


class Overlap:
    """One session's proposal drafted ahead (off: every method is a no-op returning None)."""

    def __init__(self, session: Session, *, pool: WorkerPool, enabled: bool, max_gamma: int) -> None:
        self.session = session
        self.pool = pool
        self.enabled = enabled
        self.max_gamma = max_gamma
        #: The next round's proposal, drafted while this round was verified, valid only for this
        #: committed prefix (the hypothesis it was drafted on).
        self._ahead: tuple[tuple[int, ...], common_pb2.Proposal] | None = None
        #: Rounds whose proposal was drafted ahead, and ahead drafts thrown away.
        self.used = self.wasted = 0

    def take(self) -> common_pb2.Proposal | None:
        """The proposal drafted ahead for the session's committed prefix, once (None: none, or the log
        moved otherwise, by a resync)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != self.session.token_ids:
            return None
        return ahead[1]

    def count(self, ahead: common_pb2.Proposal | None, proposed: Proposed) -> None:
        """Count a round that used the proposal drafted ahead (it made no call: ``wall_ns`` 0)."""
        if ahead is not None and proposed.wall_ns == 0 and proposed.source == "model":
            self.used += 1
            metrics.OVERLAP_DRAFTS.labels(outcome="used").inc()

    def start(self, proposed: Proposed) -> asyncio.Task[common_pb2.Proposal | None] | None:
        """Start drafting the round after this one, beside its verify (None: overlap off, or the round's
        proposal is not the model's)."""
        if not (self.enabled and proposed.source == "model" and proposed.proposal.token_ids):
            return None
        gamma = len(proposed.proposal.token_ids)
        return self.pool.propose_ahead(
            self.session, proposed.proposal.token_ids, min(gamma + 1, self.max_gamma + 1)
        )

    async def finish(
        self,
        drafting: asyncio.Task[common_pb2.Proposal | None] | None,
        proposal: tuple[int, ...],
        verdict: Verdict | None,
    ) -> None:
        """Keep the ahead draft for the next round when the verdict bears its hypothesis out.

        The hypothesis: every proposed token accepted and the bonus token equal to the draft's first
        token. Then the draft drafted the rest after exactly the prefix the session now holds, with
        the same position-keyed randomness: it is the proposal a Propose would return now (waiting
        for it, when it is still drafting, costs less than a new call). Otherwise it is cancelled or
        thrown away, and the next Propose resends the whole prefix (the draft recorded the
        hypothetical one; a full resend does not depend on the order the two requests arrive in).
        """
        if drafting is None:
            return
        s = self.session
        all_in = (
            verdict is not None
            and not verdict.finish_reason
            and verdict.accepted_count == len(proposal)
            and len(verdict.committed_token_ids) == len(proposal) + 1
        )
        ready = None
        if all_in:
            # A draft still under way is awaited (cheaper than a new call): the round waits on the draft
            # tier for it, as it would for a Propose, and the stats count that wait as the draft's.
            start_ns = time.perf_counter_ns()
            ready = await drafting
            s.stats.draft_ns += time.perf_counter_ns() - start_ns
        if not drafting.done():
            drafting.cancel()
        if (
            verdict is not None
            and ready is not None
            and len(ready.token_ids) > 1
            and (ready.token_ids[0] == verdict.committed_token_ids[-1])
        ):
            rest = common_pb2.Proposal(token_ids=ready.token_ids[1:])
            rest.distributions.extend(ready.distributions[1:])
            self._ahead = (s.token_ids + tuple(verdict.committed_token_ids), rest)
        else:
            self.wasted += 1
            metrics.OVERLAP_DRAFTS.labels(outcome="wasted").inc()
            s.draft_lost()

    @staticmethod
    def cancel(drafting: asyncio.Task[common_pb2.Proposal | None] | None) -> None:
        """The round failed: stop drafting ahead."""
        if drafting is not None:
            drafting.cancel()
