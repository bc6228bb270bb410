"""A session's relay of the target's features to its draft replica (docs/design.md, "The feature head").

The coordinator never decodes features: it keeps the bytes the target's
verdicts bring (:class:`~specserve.core.features.FeatureBlock`), asks the target
for the positions it lacks, and sends the draft what it has not sent it yet.

* **Asking the target**: every Verify item of a feature session sets
  ``features_from`` to the first position the relay lacks (:meth:`FeatureRelay.ask_from`);
  the result's features (:meth:`FeatureRelay.add`) continue what it keeps. A
  result without them (a replayed verdict) costs nothing: the next item asks
  from the same position.
* **What it keeps**: every row not yet sent to the draft, and the last
  ``window`` rows besides. A draft replica that has never seen the session (a
  failover, an eviction) is sent those rows with ``features_reset``; the head
  then attends over that window only (docs/design.md says what that costs).
* **Sending the draft**: a round can draft with the head when the relay holds
  the features of every position before the last committed token
  (:meth:`FeatureRelay.ready`); :meth:`FeatureRelay.outgoing` gives the rows the
  replica lacks (all kept rows, with reset, for a replica other than the last
  one it sent to, or after :meth:`FeatureRelay.refused`). :meth:`FeatureRelay.sent`
  records that a replica took them.
"""

from __future__ import annotations

from specserve.core.features import FeatureBlock

#: Rows kept beyond those not yet sent, per session: the context a new draft replica is rebuilt from.
DEFAULT_WINDOW = 256


class FeatureRelay:
    """One session's features in the coordinator (see the module docstring)."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.kept: FeatureBlock | None = None
        self.endpoint: str | None = None  # the draft replica sent to last
        self.sent_upto = 0  # that replica holds the features of positions before this
        self._reset = True

    def ask_from(self) -> int:
        """The first position whose features the relay lacks (``VerifyItem.features_from``)."""
        return 0 if self.kept is None else self.kept.stop

    def add(self, block: FeatureBlock) -> None:
        """The features a verdict brought. A block that does not continue the kept rows replaces them
        (the next send resets the draft's context)."""
        if self.kept is None or block.start > self.kept.stop or block.hidden != self.kept.hidden:
            self.kept = block
            self._reset = True
        else:
            self.kept = self.kept.join(block)
        self._trim()

    def ready(self, committed_len: int) -> bool:
        """Whether the relay holds the features of every position before the last committed token."""
        return self.kept is not None and self.kept.count > 0 and self.kept.stop >= committed_len - 1

    def outgoing(self, endpoint: str, committed_len: int) -> tuple[FeatureBlock, bool]:
        """``(rows, reset)``: what the replica at ``endpoint`` lacks for a proposal after ``committed_len``
        tokens (call only when :meth:`ready`)."""
        assert self.kept is not None
        reset = self._reset or endpoint != self.endpoint
        start = self.kept.start if reset else max(self.sent_upto, self.kept.start)
        return self.kept.slice(start, committed_len - 1), reset

    def sent(self, endpoint: str, block: FeatureBlock) -> None:
        """The replica at ``endpoint`` took ``block`` (its Propose succeeded)."""
        self.endpoint = endpoint
        self.sent_upto = block.stop
        self._reset = False
        self._trim()

    def refused(self) -> None:
        """The replica lacked earlier features (FAILED_PRECONDITION): the next send starts a fresh context."""
        self._reset = True

    def _trim(self) -> None:
        """Keep unsent rows and the last ``window`` rows."""
        if self.kept is None:
            return
        start = min(self.sent_upto if not self._reset else self.kept.start, self.kept.stop - self.window)
        if start > self.kept.start:
            self.kept = self.kept.slice(start, self.kept.stop)
