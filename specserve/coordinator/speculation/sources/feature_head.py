"""The feature head: a draft layer that reads the target's own features, which this source relays from the
target's verdicts to the session's draft replica (docs/design.md, "The feature head").

The coordinator never decodes features: its :class:`FeatureRelay` keeps the bytes the target's verdicts bring,
asks the target for the positions the draft lacks (:meth:`FeatureRelay.ask`), and sends the draft what it has
not sent it yet in bounded messages (:meth:`FeatureRelay.outgoing`), resetting the draft's context where the
rows it needs are gone; it never holds more than ``max_bytes``.
"""

from __future__ import annotations

from dataclasses import replace

from specserve.api.params import PROPOSER_KINDS
from specserve.coordinator.messages import NO_PROPOSAL, FeatureAsk, Proposal, Verified, VerifyRequest
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.source import Fleet, Source, SourceSetup
from specserve.core.features import VALUE_BYTES, FeatureBlock
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.runtime import metrics

#: Rows kept beyond those not yet sent, per session: the context a new draft replica is rebuilt from.
DEFAULT_WINDOW = 256
#: Most bytes of features the relay keeps for one session (``CoordinatorSettings.features_per_session_bytes``).
DEFAULT_MAX_BYTES = 2 * 1024 * 1024


class FeatureHead(Source):
    """The feature head through a draft call, with the session's :class:`FeatureRelay`. Until the relay holds
    features (the target's prefill brings the first) the head has nothing to draft from."""

    name = "feature"
    free = False
    trees = True

    def __init__(self, session: Session, fleet: Fleet, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__()
        self.session = session
        self.fleet = fleet
        self.relay = FeatureRelay(max_bytes=max_bytes)

    @classmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        if setup.request.speculation.proposer != PROPOSER_KINDS["feature"]:
            return None
        return cls(setup.session, setup.fleet, max_bytes=setup.settings.features_per_session_bytes)

    def ready(self) -> bool:
        return self.relay.ready(self.session.committed_len)

    async def propose(self, gamma: int, tree: TreeBudget = CHAIN) -> Proposal:
        if not self.ready():
            return NO_PROPOSAL
        return await self.fleet.propose(self.session, gamma, features=self.relay, tree=tree)

    def ask(self, request: VerifyRequest) -> VerifyRequest:
        """Every Verify item asks the target for the features the head will need (the relay's :meth:`~FeatureRelay.ask`)."""
        return replace(request, features=self.relay.ask())

    def verified(self, verified: Verified) -> None:
        if verified.features is not None:
            metrics.FEATURE_BYTES.labels(hop="from_target").inc(len(verified.features.data))
            self.relay.add(verified.features)


class FeatureRelay:
    """One session's features in the coordinator (docs/design.md, "The feature head")."""

    def __init__(self, window: int = DEFAULT_WINDOW, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.window = window
        self.max_bytes = max_bytes
        self.kept: FeatureBlock | None = None
        self.endpoint: str | None = None  # the draft replica sent to last
        self.sent_upto = 0  # that replica holds the features of positions before this
        self.want_from: int | None = None  # the draft needs rows from here that the relay lacks
        self._reset = False

    def ask(self) -> FeatureAsk:
        """What the next Verify item asks for: the rows the draft needs that the relay lacks."""
        if self.want_from is not None:
            return FeatureAsk(self.want_from, False, self.max_bytes)
        if self.kept is None:
            return FeatureAsk(0, True, self.max_bytes)
        return FeatureAsk(self.kept.stop, False, self.max_bytes)

    def add(self, block: FeatureBlock) -> None:
        """The features a verdict brought. Rows the draft asked for, or rows that do not continue the kept
        ones, replace them (the latter reset the draft's context at the next send)."""
        if self.want_from is not None and block.start <= self.want_from:
            self.kept, self.want_from = block, None
        elif self.kept is None or block.start > self.kept.stop or block.hidden != self.kept.hidden:
            self._reset = self.kept is not None and self.endpoint is not None
            self.kept = block
        else:
            self.kept = self.kept.join(block)
        self._trim()

    def ready(self, committed_len: int) -> bool:
        """Whether a Propose has something to carry: rows the draft lacks, or every row up to the last
        committed token's predecessor (it then drafts)."""
        if self.kept is None or self.want_from is not None:
            return False
        if self.kept.count > 0 and self.kept.stop >= committed_len - 1:
            return True
        return self.kept.stop > self._send_start(self.endpoint)

    def outgoing(self, endpoint: str, committed_len: int, max_bytes: int) -> tuple[FeatureBlock, bool]:
        """``(rows, reset)``: what the replica at ``endpoint`` lacks for a proposal after ``committed_len``
        tokens, at most ``max_bytes`` of it (at least one row; call only when :meth:`ready`)."""
        assert self.kept is not None
        reset = self._reset or (self.endpoint is not None and endpoint != self.endpoint)
        start = self._send_start(endpoint)
        rows = max(1, max_bytes // self._row_bytes())
        return self.kept.slice(start, min(committed_len - 1, start + rows)), reset

    def sent(self, endpoint: str, block: FeatureBlock) -> None:
        """The replica at ``endpoint`` took ``block`` (its Propose succeeded)."""
        metrics.FEATURE_BYTES.labels(hop="to_draft").inc(len(block.data))
        self.endpoint = endpoint
        self.sent_upto = block.stop
        self._reset = False
        self._trim()

    def needed(self, endpoint: str, position: int, committed_len: int) -> bool:
        """The replica at ``endpoint`` lacks the features from ``position`` on (its reply said so). Returns
        whether to send again at once: it lacks rows it was thought to hold, and the relay holds them (a
        replica that took every row it was sent gets the next ones with the next round)."""
        self.endpoint = endpoint
        kept = self.kept
        if kept is not None and kept.start <= position <= kept.stop:
            again = position < min(self.sent_upto, kept.stop)
            self.sent_upto = position
            self._reset = False
            return again
        rows = committed_len - 1 - position
        if kept is None or rows * self._row_bytes() <= self.max_bytes:
            self.want_from = position  # the target sends them; the draft continues its context with them
            self.sent_upto = position
            self._reset = False
            return False
        self._reset = True  # too far back to keep: the replica rebuilds from the rows kept
        return False

    def refused(self) -> None:
        """The replica lost the session's context (FAILED_PRECONDITION, a failure): the next send rebuilds it."""
        self._reset = True

    def _row_bytes(self) -> int:
        return (self.kept.hidden if self.kept is not None else 1) * VALUE_BYTES

    def _send_start(self, endpoint: str | None) -> int:
        """The first kept position the replica at ``endpoint`` lacks."""
        assert self.kept is not None
        if self._reset or endpoint is None or endpoint != self.endpoint:
            return self.kept.start
        return max(self.sent_upto, self.kept.start)

    def _trim(self) -> None:
        """Keep unsent rows and the last ``window`` rows, at most ``max_bytes`` in all: past that the oldest
        go, and when the replica has not had them its context is rebuilt at the next send."""
        if self.kept is None:
            return
        start = self.kept.start
        if self.endpoint is not None and not self._reset:
            start = max(start, min(self.sent_upto, self.kept.stop - self.window))
        cap = max(1, self.max_bytes // self._row_bytes())
        if self.kept.stop - start > cap:
            start = self.kept.stop - cap
            if self.endpoint is not None and start > self.sent_upto:
                self._reset = True
        if start > self.kept.start:
            self.kept = self.kept.slice(start, self.kept.stop)
