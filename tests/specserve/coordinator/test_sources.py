"""The proposal sources that draft in the coordinator (``specserve/coordinator/speculation/sources/``: pure Python,
no servers).

The system tests (the output equals the target's own greedy text, no draft call is made) are in
``test_rounds_prediction.py``; these pin the alignment and the counting.
"""

from __future__ import annotations

import random

import pytest

from specserve.coordinator.speculation.sources.ngram import Ngram
from specserve.coordinator.speculation.sources.prediction import Prediction
from specserve.core.ngram import ngram_lookup

pytestmark = pytest.mark.unit

PREDICTION = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def test_a_completion_that_follows_the_prediction_is_drafted_from_it_and_counted():
    p = Prediction(PREDICTION)
    assert p.ready() and p.alignment == 0
    assert p.draft(3) == (1, 2, 3)
    p.observe((1, 2, 3, 4))  # all three accepted, and the bonus token is the prediction's next one
    assert (p.accepted_tokens, p.rejected_tokens, p.alignment) == (4, 0, 4)
    assert p.draft(8) == (5, 6, 7, 8, 9), "the rest of the prediction"
    p.observe((5, 6, 7, 8, 9))
    assert (p.accepted_tokens, p.rejected_tokens) == (9, 0)
    assert not p.ready() and p.draft(4) == (), "used up: the session's own proposer drafts"
    p.observe((10,))
    assert p.accepted_tokens == 9


def test_rejected_tokens_are_counted_and_a_gamma_of_0_proposes_nothing():
    p = Prediction(PREDICTION)
    assert p.draft(0) == ()
    assert p.draft(4) == (1, 2, 3, 4)
    p.observe((1, 2, 42))  # two accepted, the third rejected: the target's correction is 42
    assert (p.accepted_tokens, p.rejected_tokens) == (2, 2)
    p.observe((3,))  # a round without a proposal from the prediction: nothing more is rejected
    assert p.rejected_tokens == 2


def test_a_stop_that_cuts_a_proposal_counts_the_rest_as_rejected():
    p = Prediction(PREDICTION)
    p.draft(4)
    p.observe((1,))  # the stop came with the first token: three drafted tokens never reached the completion
    assert (p.accepted_tokens, p.rejected_tokens) == (1, 3)


def test_after_an_insertion_the_alignment_is_found_again_where_the_prediction_resumes():
    p = Prediction(PREDICTION)
    p.observe((1, 2, 3, 42))  # the completion inserts 42 after 3
    assert p.alignment is None and not p.ready() and p.draft(4) == ()
    p.observe((43, 4))  # ... and more, then resumes the prediction at 4: one token is not evidence enough
    assert p.alignment is None
    p.observe((5,))  # "4 5" is
    assert p.alignment == 5 and p.draft(3) == (6, 7, 8)
    p.observe((6, 7, 8))
    assert p.accepted_tokens == 3 + 3, "tokens found while re-aligning are not counted, those after are"


def test_after_a_deletion_the_alignment_skips_ahead():
    p = Prediction(PREDICTION)
    p.observe((1, 2, 3, 6, 7))  # 4 and 5 deleted
    assert p.alignment == 7 and p.draft(2) == (8, 9)


def test_realignment_prefers_the_longest_match_then_the_first_occurrence_ahead():
    prediction = (7, 1, 2, 3, 7, 1, 2, 4, 0, 1, 2, 5)
    p = Prediction(prediction)
    p.observe((7, 1, 2, 3, 7, 55, 1, 2))  # lost at 5; "1 2" occurs at 1, 5 and 9: the first ahead is 5
    assert p.alignment == 7 and p.draft(2) == (4, 0)
    q = Prediction(prediction)
    q.observe((7, 1, 2, 3, 7, 1, 2, 4, 0, 1, 2, 5, 99, 7, 1))  # used up, then "7 1": latest before, at 4
    assert q.alignment == 6
    r = Prediction(prediction)
    r.observe((99, 4, 0, 1))  # lost at 0; the 3-gram "4 0 1" (at 7) wins over "0 1" and "1"
    assert r.alignment == 10 and r.draft(3) == (2, 5)
    s = Prediction(prediction, min_n=1)  # single tokens may re-align too
    s.observe((7, 1, 2, 3, 7, 55, 1))
    assert s.alignment == 6 and s.draft(2) == (2, 4)


def test_a_completion_unrelated_to_the_prediction_gets_nothing_from_it():
    p = Prediction(PREDICTION)
    p.observe((20, 21, 22))
    assert not p.ready() and p.draft(4) == () and p.accepted_tokens == 0


def test_the_ngram_proposer_is_the_lookup_over_prompt_and_completion():
    rng = random.Random(1)
    prompt = [rng.randrange(5) for _ in range(20)]
    proposer = Ngram(prompt)
    seen = list(prompt)
    for _ in range(40):
        gamma = rng.randrange(1, 6)
        assert proposer.draft(gamma) == ngram_lookup(seen, gamma)
        assert proposer.ready() == bool(ngram_lookup(seen, 1))
        new = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        proposer.observe(new)
        seen += new


def test_peeking_at_a_prediction_counts_nothing():
    """The round loop's guess at gamma 0 (``shadow``) is not a proposal: no token of it counts as rejected."""
    proposer = Prediction([1, 2, 3, 4])
    assert proposer.shadow(2) == (1, 2)
    proposer.observe([9])
    assert proposer.rejected_tokens == 0 and proposer.accepted_tokens == 0
    assert proposer.draft(2) == ()  # alignment lost at 9


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    import tiny_models

    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_forced_text_is_proposed_as_the_tokenizer_spells_it_and_followed_along_the_log(tiny_tokenizer):
    """A JSON schema's keys and punctuation are forced: the proposer offers their tokens (then EOS once the
    object is closed), follows the committed tokens, and offers nothing where the model has a choice."""
    import json

    from specserve.api.constraints import Constraint
    from specserve.coordinator.speculation.sources.forced_text import ForcedText
    from specserve.engine.grammar import GrammarEngine

    tok = tiny_tokenizer
    engine = GrammarEngine(tok, 384, [0])
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    }
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    forced = ForcedText(engine.matcher(Constraint("json_schema", json.dumps(schema))), encode)
    assert forced.ready() and forced.shadow(32) == tuple(encode('{"x": '))
    assert forced.shadow(2) == tuple(encode('{"x": '))[:2]
    forced.observe(encode('{"x": '))
    assert not forced.ready() and forced.shadow(4) == ()  # the integer is the model's choice
    forced.observe(encode("12"))
    assert not forced.ready()  # more digits, or the next key
    forced.observe(encode(", "))
    assert forced.shadow(32) == tuple(encode('"y": '))
    forced.observe(encode('"y": true'))
    assert forced.shadow(8) == (*encode("}"), 0)  # the object closes, and then the end is all that is allowed
    forced.observe((*encode("}"), 0))
    assert not forced.ready()


def test_a_committed_token_outside_the_grammar_stops_the_forced_text(tiny_tokenizer):
    from specserve.api.constraints import Constraint
    from specserve.coordinator.speculation.sources.forced_text import ForcedText
    from specserve.engine.grammar import GrammarEngine

    engine = GrammarEngine(tiny_tokenizer, 384, [0])
    forced = ForcedText(engine.matcher(Constraint("regex", "abc[0-9]")), tiny_tokenizer.encode)
    assert forced.ready()
    forced.observe(tiny_tokenizer.encode("x"))
    assert not forced.ready() and forced.shadow(4) == ()
