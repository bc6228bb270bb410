"""specserve.target.stops: cutting a round's new tokens at the first stop condition (real tiny tokenizer)."""

from __future__ import annotations

import pytest
import tiny_models

from specserve.api.params import StopConditions
from specserve.target.stops import cut_at_stop
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

EOS = 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("stops_tok"))


def cut(new, stop, tokenizer=None, completion=()):
    return cut_at_stop(
        new, completion_token_ids=completion, stop=stop, eos_token_ids=frozenset({EOS}), tokenizer=tokenizer
    )


def test_no_stop_keeps_everything():
    got = cut([5, 6, 7], StopConditions(max_new_tokens=10))
    assert (got.token_ids, got.finish_reason) == ((5, 6, 7), common_pb2.FINISH_REASON_UNSPECIFIED)


def test_eos_is_kept_and_ends_the_cut_unless_ignored():
    got = cut([5, EOS, 7], StopConditions(max_new_tokens=10))
    assert (got.token_ids, got.finish_reason) == ((5, EOS), common_pb2.FINISH_REASON_EOS)
    got = cut([5, EOS, 7], StopConditions(max_new_tokens=10, ignore_eos=True))
    assert got.token_ids == (5, EOS, 7) and got.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


def test_stop_token_and_length_count_after_the_prompt():
    got = cut([5, 9, 7], StopConditions(max_new_tokens=10, stop_token_ids=(9,)))
    assert (got.token_ids, got.finish_reason) == ((5, 9), common_pb2.FINISH_REASON_STOP_TOKEN)
    # 3 tokens generated before this round, max 5: two more, then LENGTH.
    got = cut([5, 6, 7], StopConditions(max_new_tokens=5), completion=(1, 2, 3))
    assert (got.token_ids, got.finish_reason) == ((5, 6), common_pb2.FINISH_REASON_LENGTH)


def test_eos_wins_over_length_at_the_same_token():
    got = cut([5, EOS], StopConditions(max_new_tokens=2))
    assert got.finish_reason == common_pb2.FINISH_REASON_EOS


def test_stop_string_spanning_old_and_new_tokens(tokenizer):
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n")
    text = tokenizer.decode
    # The stop string straddles the boundary between committed completion and this round's tokens.
    split = len(ids) // 2
    stop_text = text(ids[split - 1 : split + 2])
    assert stop_text not in text(ids[: split + 1])
    got = cut(ids[split:], StopConditions(stop_strings=(stop_text,)), tokenizer, completion=ids[:split])
    assert got.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert got.token_ids == tuple(ids[split : split + 2])


def test_stop_string_not_present_keeps_going(tokenizer):
    ids = tokenizer.encode("for i in range(10):\n    print(i)\n")
    got = cut(ids, StopConditions(stop_strings=("lambda",)), tokenizer)
    assert got.token_ids == tuple(ids) and got.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize("specials", [0, 16, 40, 200])
def test_a_stop_string_split_by_many_special_tokens_is_still_found(tokenizer, specials):
    """Special tokens decode to nothing, so however many sit inside a stop string's tokens, the text holds the
    stop string and the round ends there (the window counts only tokens that decode to text)."""
    head = tokenizer.encode("def add(a, b):\n    ret", add_special_tokens=False)
    rest = tokenizer.encode("urn a + b", add_special_tokens=False)
    completion = [*head, *([EOS] * specials)]
    assert tokenizer.decode(completion + rest, skip_special_tokens=True) == "def add(a, b):\n    return a + b"
    stop = StopConditions(max_new_tokens=1000, stop_strings=("return",), ignore_eos=True)
    got = cut(rest, stop, tokenizer, completion=completion)
    assert got.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert tokenizer.decode(completion + list(got.token_ids), skip_special_tokens=True).endswith("return")
