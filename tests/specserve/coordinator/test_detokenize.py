"""Incremental detokenization never splits a multi-byte character, and stop strings cut the text."""

from __future__ import annotations

import pytest
import system_fixtures as sf

from specserve.coordinator.detokenize import IncrementalDetokenizer

pytestmark = pytest.mark.unit

TEXTS = ["héllo wörld", "def f(x):\n    return '世界🙂'", "🙂🙂 naïve café", "plain ascii text"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_add_up_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    if any(ord(c) > 127 for c in text):
        # Multi-byte characters span several byte-level tokens: some pushes must have held text back.
        assert "" in deltas[:-1]


def test_chunks_of_several_tokens(tokenizer):
    text = TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.finish()
    assert out == text


def test_special_tokens_are_not_in_the_text(tokenizer):
    ids = [*tokenizer.encode("abc", add_special_tokens=False), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push([t]) for t in ids) + detok.finish() == "abc"


@pytest.mark.parametrize("stop", ["return", "x)", "🙂"])
def test_stop_string_cuts_the_text_at_the_end_of_the_first_match(tokenizer, stop):
    text = "def f(x):\n    return '世界🙂' + return"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop_strings=[stop])
    out = "".join(detok.push([t]) for t in ids) + detok.finish()
    assert out == text[: text.index(stop) + len(stop)]
    assert detok.push([5]) == ""  # nothing after the stop
