"""specserve.core.ngram: the one n-gram lookup, against a plain scan of the sequence."""

from __future__ import annotations

import random

import pytest

from specserve.api.errors import InvalidArgument
from specserve.core.ngram import NgramIndex, ngram_lookup

pytestmark = pytest.mark.unit


def scan_lookup(tokens, gamma, *, max_n=3, min_n=1):
    """Prompt lookup by scanning: the first start of the last n tokens (not the suffix's own), n from max_n down."""
    length = len(tokens)
    if gamma <= 0:
        return ()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for i in range(length - n):
            if list(tokens[i : i + n]) == suffix:
                return tuple(tokens[i + n : i + n + gamma])
    return ()


@pytest.mark.parametrize(
    ("tokens", "gamma", "expected"),
    [
        ((1, 2, 3, 4, 5, 6, 1, 2, 3), 3, (4, 5, 6)),  # 3-gram match
        ((1, 2, 3, 4, 5, 6, 1, 2, 3), 10, (4, 5, 6, 1, 2, 3)),  # runs up to the end of the history
        ((9, 2, 3, 7, 8, 1, 2, 3, 5, 6, 2, 3), 2, (7, 8)),  # the first of two occurrences
        ((4, 9, 9, 1, 8, 9), 2, (9, 1)),  # no 3- or 2-gram match: the 1-gram 9, first at index 1
        ((1, 2, 3), 4, ()),  # nothing repeats
        ((7,), 4, ()),
        ((1, 2, 1, 2), 0, ()),
        ((5, 5, 5, 5), 2, (5,)),  # overlapping occurrences: the first start of "5 5 5" is 0
    ],
)
def test_ngram_lookup(tokens, gamma, expected):
    assert ngram_lookup(tokens, gamma) == expected == scan_lookup(tokens, gamma)


def test_the_longest_match_wins_and_max_n_bounds_it():
    # The 1-gram "3" first occurred before 9, the 3-gram "1 2 3" before 4: the longer match wins.
    tokens = (3, 9, 0, 1, 2, 3, 4, 0, 1, 2, 3)
    assert ngram_lookup(tokens, 2) == (4, 0)
    assert ngram_lookup(tokens, 2, max_n=1) == (9, 0)


def test_a_copy_follows_the_source_not_a_later_repeat_of_its_gram():
    # A prompt holding a fenced block, then the answer opening its own fence: "```" occurs as the
    # source's opening fence (followed by "python") and its closing one (followed by the end of the
    # turn); the copy continues the opening one.
    fence, python, body, end, newline = 10, 11, (20, 21, 22), 12, 13
    prompt = (newline, fence, python, newline, *body, newline, fence, end, newline)
    assert ngram_lookup((*prompt, newline, fence), 4) == (python, newline, *body[:2])  # latest: (end, newline, ...)


def test_the_index_grown_token_by_token_equals_a_scan_at_every_length():
    rng = random.Random(0)
    for max_n, min_n, alphabet in ((3, 1, 4), (4, 2, 3), (1, 1, 6), (5, 1, 2)):
        tokens = [rng.randrange(alphabet) for _ in range(300)]
        index = NgramIndex(tokens[:1], max_n=max_n, min_n=min_n)
        for length in range(2, len(tokens) + 1):
            index.extend(tokens[length - 1 : length])
            gamma = rng.randrange(1, 9)
            assert index.lookup(gamma) == scan_lookup(tokens[:length], gamma, max_n=max_n, min_n=min_n), length
        assert index.tokens == tuple(tokens) and len(index) == len(tokens)


def test_occurrences_lists_every_start_in_order():
    index = NgramIndex((1, 2, 1, 2, 1), max_n=3)
    assert index.occurrences((1, 2)) == [0, 2]
    assert index.occurrences((1,)) == [0, 2, 4]
    assert index.occurrences((2, 1, 2)) == [1]
    assert index.occurrences((3,)) == [] and index.occurrences((1, 2, 1, 2)) == []  # longer than max_n


def test_bad_bounds_are_refused():
    with pytest.raises(InvalidArgument):
        NgramIndex(max_n=1, min_n=2)
    with pytest.raises(InvalidArgument):
        NgramIndex(min_n=0)
