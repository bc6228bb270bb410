"""specserve.prompts.chat: the train / held-out split the draft, the feature head and the benchmark share is
the one they were trained and measured with (a change to a list or to the split moves these digests)."""

from __future__ import annotations

import hashlib

import pytest

from specserve.prompts import chat

pytestmark = pytest.mark.unit


def _digest(prompts: list[chat.ChatPrompt]) -> str:
    return hashlib.sha256(repr([(p.name, p.messages, p.follow_up) for p in prompts]).encode()).hexdigest()


def test_the_split_is_the_one_the_shipped_draft_and_head_were_trained_on():
    training = chat.training_prompts()
    heldout = chat.heldout_prompts("chat") + chat.heldout_prompts("code")
    assert (len(training), len(heldout)) == (3088, 358)
    assert _digest(training) == "2d711c7ba936fd813e2276d77fb62236af174b82033236553338d8c454aba4ea"
    assert _digest(heldout) == "2780b4049ad6ce2d95e4c759c439e41f1cc849e453a95e502515c2fc9a78698a"


def test_no_held_out_subject_is_trained_on():
    trained = {p.subject for p in chat.training_prompts()}
    heldout = {p.subject for kind in ("chat", "code") for p in chat.heldout_prompts(kind)}
    assert heldout and not trained & heldout
