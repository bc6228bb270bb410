"""The feature head's relay (specserve/coordinator/speculation/sources/feature_head.py): what a session asks the target for, keeps, and sends its draft replica."""

from __future__ import annotations

import pytest

from specserve.coordinator.messages import FeatureAsk
from specserve.coordinator.speculation.sources.feature_head import FeatureRelay
from specserve.core.features import VALUE_BYTES, FeatureBlock

pytestmark = pytest.mark.unit

HIDDEN = 3
ROW = HIDDEN * VALUE_BYTES
BIG = 10**9  # a message budget that never binds


def rows(start: int, stop: int) -> FeatureBlock:
    """Rows whose bytes name their position (so a slice can be checked byte for byte)."""
    data = b"".join(bytes([p % 256]) * ROW for p in range(start, stop))
    return FeatureBlock(start=start, hidden=HIDDEN, data=data)


def test_a_session_asks_from_what_it_lacks_and_sends_each_row_once():
    relay = FeatureRelay(window=100)
    # The first ask starts where the target's prefix-cache hit ends (the draft's cache holds the rest).
    assert relay.ask() == FeatureAsk(0, True, relay.max_bytes) and not relay.ready(11)
    relay.add(rows(0, 10))  # the first verdict: the prompt's features and the pending token's
    assert relay.ready(11)
    block, reset = relay.outgoing("a", 11, BIG)
    assert (block, reset) == (rows(0, 10), False)  # the first send: the replica may use its prefix cache
    relay.sent("a", block)
    assert not relay.ready(12)  # nothing new to carry, and not every row for a proposal after 12 tokens
    relay.add(rows(10, 13))
    assert relay.ask() == FeatureAsk(13, False, relay.max_bytes)
    block, reset = relay.outgoing("a", 14, BIG)
    assert (block, reset) == (rows(10, 13), False)


def test_sent_rows_beyond_the_window_go_and_a_new_replica_gets_the_window_with_reset():
    relay = FeatureRelay(window=4)
    relay.add(rows(0, 10))
    assert relay.kept == rows(0, 10)  # nothing sent yet: every row stays
    relay.sent("a", relay.outgoing("a", 11, BIG)[0])
    assert relay.kept == rows(6, 10)
    relay.add(rows(10, 13))
    assert relay.outgoing("b", 14, BIG) == (rows(9, 13), True)  # a failover: the window, a fresh context
    relay.sent("b", rows(9, 13))
    relay.refused()  # the replica lost it (evicted): the window again, with reset
    assert relay.outgoing("b", 14, BIG) == (rows(9, 13), True)


def test_features_that_do_not_continue_replace_the_kept_ones():
    relay = FeatureRelay(window=8)
    relay.add(rows(0, 5))
    relay.sent("a", rows(0, 5))
    relay.add(rows(7, 9))  # a gap (positions 5, 6 never came): start over from these
    assert relay.kept == rows(7, 9)
    assert relay.outgoing("a", 10, BIG) == (rows(7, 9), True)


def test_rows_go_to_the_draft_in_bounded_messages_and_it_drafts_once_all_are_there():
    """Bounded features (issue 54, finding 4): each send carries at most the message budget; the replica
    names where it stopped, the next round sends on from there."""
    relay = FeatureRelay(window=4)
    relay.add(rows(0, 30))
    block, _ = relay.outgoing("a", 31, 10 * ROW)
    assert block == rows(0, 10)
    relay.sent("a", block)
    assert relay.needed("a", 10, 31) is False  # nothing more to send at once: it fed all it got
    assert relay.ready(31)  # rows left to carry: the next round sends them
    block, reset = relay.outgoing("a", 31, 10 * ROW)
    assert (block, reset) == (rows(10, 20), False)
    relay.sent("a", block)
    block, _ = relay.outgoing("a", 31, 10 * ROW)
    assert block == rows(20, 30) and relay.ready(31)


def test_the_draft_names_what_it_needs_and_the_relay_sends_it_or_asks_the_target():
    """The handshake of the prefix cache (issue 53): the first rows start where the target's hit ends; a
    replica whose own hit ends earlier names its first position, and the relay asks the target from there."""
    relay = FeatureRelay(window=4)
    relay.add(rows(32, 40))  # the target attached 32 tokens: the rows after them
    relay.sent("a", relay.outgoing("a", 41, BIG)[0])
    assert relay.needed("a", 16, 41) is False  # the replica holds only 16: ask the target from there
    assert relay.ask().start == 16 and not relay.ready(41)
    relay.add(rows(16, 41))
    assert relay.kept == rows(16, 41) and relay.ask().start == 41
    assert relay.outgoing("a", 42, BIG) == (rows(16, 41), False)  # it continues its own context with them
    # A replica that needs rows the relay holds gets them at once, without a reset.
    relay.sent("a", rows(16, 41))
    assert relay.kept == rows(37, 41)  # the window
    assert relay.needed("a", 38, 42) is True
    assert relay.outgoing("a", 42, BIG) == (rows(38, 41), False)
    # Too far back to keep: the replica rebuilds from what is kept.
    small = FeatureRelay(window=4, max_bytes=8 * ROW)
    small.add(rows(90, 99))
    small.sent("a", small.outgoing("a", 100, BIG)[0])
    assert small.needed("a", 0, 100) is False and small.outgoing("a", 100, BIG)[1] is True


@pytest.mark.parametrize("state", ["unsent", "reset pending", "not drafting"])
def test_the_relay_keeps_at_most_its_budget_in_every_state_and_resets_when_unsent_rows_go(state):
    """Bounded memory (issue 54, finding 5): rows that arrive while none are sent (the first rounds, a reset
    pending, rounds that do not draft: gamma 0, an open breaker, a lookup) never pass ``max_bytes``; the
    oldest go, and when the replica had not had them it rebuilds from the rows kept."""
    relay = FeatureRelay(window=4, max_bytes=50 * ROW)
    relay.add(rows(0, 10))
    if state != "unsent":
        relay.sent("a", relay.outgoing("a", 11, BIG)[0])
    if state == "reset pending":
        relay.refused()
    for start in range(10, 1004, 7):
        relay.add(rows(start, start + 7))
        assert relay.kept is not None and len(relay.kept.data) <= 50 * ROW
    assert relay.kept == rows(1004 - 50, 1004)
    block, reset = relay.outgoing("a", 1005, BIG)
    assert block == rows(1004 - 50, 1004) and reset == (state != "unsent")


def test_a_relay_checks_its_settings():
    with pytest.raises(ValueError, match="window"):
        FeatureRelay(window=0)
    with pytest.raises(ValueError, match="max_bytes"):
        FeatureRelay(max_bytes=0)


def test_the_feature_budgets_default_to_a_quarter_of_the_message_limit_and_refuse_more_than_half():
    from specserve.runtime.config import CoordinatorSettings, TargetSettings

    for cls, extra in ((CoordinatorSettings, {"target_endpoints": ["x:1"]}), (TargetSettings, {})):
        settings = cls(host="127.0.0.1", max_message_bytes=64 * 1024, **extra)
        assert settings.feature_bytes_per_call == 16 * 1024
        assert cls(host="127.0.0.1", features_per_call_bytes=32 * 1024, max_message_bytes=64 * 1024, **extra)
        with pytest.raises(ValueError, match="features_per_call_bytes=40000"):
            cls(host="127.0.0.1", features_per_call_bytes=40_000, max_message_bytes=64 * 1024, **extra)
