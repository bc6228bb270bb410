"""coordinator.feature_relay: what a session asks the target for, keeps, and sends its draft replica."""

from __future__ import annotations

import pytest

from coordinator.feature_relay import FeatureRelay
from specserve.core.features import VALUE_BYTES, FeatureBlock

pytestmark = pytest.mark.unit

HIDDEN = 3


def rows(start: int, stop: int) -> FeatureBlock:
    """Rows whose bytes name their position (so a slice can be checked byte for byte)."""
    data = b"".join(bytes([p % 256]) * (HIDDEN * VALUE_BYTES) for p in range(start, stop))
    return FeatureBlock(start=start, hidden=HIDDEN, data=data)


def test_a_session_asks_from_what_it_lacks_and_sends_each_row_once():
    relay = FeatureRelay(window=100)
    assert relay.ask_from() == 0 and not relay.ready(11)
    relay.add(rows(0, 10))  # the first verdict: the prompt's features and the pending token's
    assert relay.ready(11) and not relay.ready(12)
    block, reset = relay.outgoing("a", 11)
    assert (block, reset) == (rows(0, 10), True)
    relay.sent("a", block)
    relay.add(rows(10, 13))
    assert relay.ask_from() == 13
    block, reset = relay.outgoing("a", 14)
    assert (block, reset) == (rows(10, 13), False)


def test_sent_rows_beyond_the_window_go_and_a_new_replica_gets_the_window_with_reset():
    relay = FeatureRelay(window=4)
    relay.add(rows(0, 10))
    assert relay.kept == rows(0, 10)  # nothing sent yet: every row stays
    relay.sent("a", relay.outgoing("a", 11)[0])
    assert relay.kept == rows(6, 10)
    relay.add(rows(10, 13))
    assert relay.outgoing("b", 14) == (rows(9, 13), True)  # a failover: the window, a fresh context
    relay.sent("b", rows(9, 13))
    relay.refused()  # the replica lost it (evicted): the window again, with reset
    assert relay.outgoing("b", 14) == (rows(9, 13), True)


def test_features_that_do_not_continue_replace_the_kept_ones():
    relay = FeatureRelay(window=8)
    relay.add(rows(0, 5))
    relay.sent("a", rows(0, 5))
    relay.add(rows(7, 9))  # a gap (positions 5, 6 never came): start over from these
    assert relay.kept == rows(7, 9)
    assert relay.outgoing("a", 10) == (rows(7, 9), True)


def test_a_window_must_hold_a_row():
    with pytest.raises(ValueError, match="window"):
        FeatureRelay(window=0)
