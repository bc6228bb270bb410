"""The grammar engine (llguidance): compiling each kind, the cache, the matcher's branch / rollback / rebuild,
end-of-sequence only where the grammar is complete, forced text, and the masks on logits."""

from __future__ import annotations

import json

import pytest
import tiny_models
import torch

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument
from specserve.engine.grammar import GrammarEngine, apply_masks, unpack

pytestmark = pytest.mark.unit

VOCAB = 384
EOS = 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return GrammarEngine(tokenizer, VOCAB, [EOS])


def allowed(matcher, vocab=VOCAB) -> set[int]:
    bitmask = matcher.allocate(1)
    matcher.fill_mask(bitmask, 0)
    return set(torch.nonzero(unpack(bitmask, vocab)[0]).flatten().tolist())


def walk(matcher, tokenizer, text: str) -> None:
    for t in tokenizer.encode(text):
        assert matcher.accept(t), (text, t)


CHOICES = ("yes", 'say "hi"\\n', "ünï", "no")


@pytest.mark.parametrize("choice", CHOICES)
def test_a_choice_accepts_exactly_its_strings_and_eos_only_at_the_end(engine, tokenizer, choice):
    matcher = engine.matcher(Constraint("choice", CHOICES))
    assert EOS not in allowed(matcher)
    walk(matcher, tokenizer, choice)
    assert allowed(matcher) == {EOS}  # complete: the only continuation is the end
    assert matcher.accept(EOS) and matcher.terminated
    assert allowed(matcher) == {EOS}  # terminated: only the end again
    assert not matcher.accept(tokenizer.encode("y")[0])


def test_each_kind_compiles_and_constrains(engine, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for constraint, good, bad in [
        (Constraint("json_schema", json.dumps(schema)), '{"n": 12}', '{"m": 1}'),
        (Constraint("json_object"), '{"a": [1, 2]}', "[1]"),
        (Constraint("regex", "[0-9]{2}-x"), "42-x", "4a"),
        (Constraint("grammar", 'root ::= "a" ("b" | "c")*'), "abcb", "ba"),
    ]:
        matcher = engine.matcher(constraint)
        walk(matcher, tokenizer, good)
        assert EOS in allowed(matcher), constraint.kind
        fresh = engine.matcher(constraint)
        assert not all(fresh.accept(t) for t in tokenizer.encode(bad)), constraint.kind


@pytest.mark.parametrize(
    ("constraint", "names"),
    [
        (Constraint("grammar", "root ::= foo"), "Rule 'foo' not found"),
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("json_schema", '{"type": "objekt"}'), "Invalid type: objekt"),
        (Constraint("grammar", 'root ::= "a" bar\nbar ::= [b-'), "grammar constraint does not compile"),
    ],
)
def test_a_constraint_that_does_not_compile_names_the_problem(engine, constraint, names):
    with pytest.raises(InvalidArgument, match=names) as info:
        engine.compile(constraint)
    assert "\n" not in info.value.message  # one line


def test_the_cache_compiles_each_constraint_once_and_drops_the_least_recent(tokenizer):
    engine = GrammarEngine(tokenizer, VOCAB, [EOS], cache_size=2)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    first = engine.compile(a)
    assert engine.compile(Constraint("regex", "a+")) is first
    assert (engine.stats.hits, engine.stats.misses) == (1, 1)
    engine.compile(b)
    engine.compile(c)  # a is the least recent: dropped
    engine.compile(a)
    assert (engine.stats.hits, engine.stats.misses) == (1, 4)
    assert engine.stats.hit_rate == pytest.approx(0.2)


def test_masks_along_a_proposal_branch_and_leave_the_state_where_it_was(engine, tokenizer):
    constraint = Constraint("regex", "(ab|ac)d")
    matcher = engine.matcher(constraint)
    a, b, c, d = (tokenizer.encode(ch)[0] for ch in "abcd")
    before = matcher.tokens
    masks = matcher.masks_along([a, c, d])
    assert matcher.tokens == before  # the branch is rolled back
    rows = unpack(masks, VOCAB)
    assert set(torch.nonzero(rows[1]).flatten().tolist()) >= {b, c}
    assert not rows[1][d]
    assert set(torch.nonzero(rows[3]).flatten().tolist()) == {EOS}
    # A token the grammar refuses: the rows after it allow everything (no acceptance rule reaches them).
    masks = matcher.masks_along([d, a])
    assert not unpack(masks, VOCAB)[0][d]
    assert unpack(masks, VOCAB)[1:].all()
    assert matcher.tokens == before


def test_sync_rolls_back_to_the_committed_prefix_and_a_fresh_matcher_rebuilds_the_same_state(engine, tokenizer):
    constraint = Constraint("json_schema", json.dumps({"type": "object", "properties": {"k": {"type": "string"}}}))
    committed = tokenizer.encode('{"k": "ab')
    matcher = engine.matcher(constraint)
    matcher.sync(committed + tokenizer.encode('c"}'))  # a branch past the committed prefix
    matcher.sync(committed)  # rejected: back to the committed prefix
    assert matcher.tokens == tuple(committed)
    rebuilt = engine.matcher(constraint)  # a replica that never saw the session
    rebuilt.sync(committed)
    assert allowed(rebuilt) == allowed(matcher)
    with pytest.raises(InvalidArgument, match="does not satisfy the json_schema constraint"):
        matcher.sync([*committed, EOS])  # the string is not closed: the end is not allowed


def test_a_stop_token_after_termination_is_consumed_and_rolled_back(engine, tokenizer):
    matcher = engine.matcher(Constraint("choice", ("no",)))
    walk(matcher, tokenizer, "no")
    n = len(matcher.tokens)
    assert matcher.accept(EOS) and matcher.accept(EOS)  # terminated: more ends change nothing
    matcher.rollback(2)
    assert not matcher.terminated and len(matcher.tokens) == n and allowed(matcher) == {EOS}


def test_forced_text_is_what_every_continuation_starts_with(engine, tokenizer):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    matcher = engine.matcher(Constraint("json_schema", json.dumps(schema)))
    assert matcher.forced_text() == '{"name": "'
    walk(matcher, tokenizer, '{"name": "x", ')
    assert matcher.forced_text() == '"age": '
    choice = engine.matcher(Constraint("choice", ("yes", "no")))
    assert choice.forced_text() == ""


def test_apply_masks_sets_forbidden_tokens_to_minus_infinity(engine, tokenizer):
    matcher = engine.matcher(Constraint("choice", ("yes", "no")))
    masks = matcher.masks_along([])
    logits = torch.randn(1, VOCAB)
    kept = logits.clone()
    apply_masks(logits, masks)
    ok = unpack(masks, VOCAB)[0]
    assert torch.equal(logits[0, ok], kept[0, ok])
    assert torch.isneginf(logits[0, ~ok]).all() and 0 < int(ok.sum()) < VOCAB


def test_keywords_the_engine_cannot_enforce_are_refused_naming_them(engine):
    schema = {"type": "object", "properties": {"not": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
    with pytest.raises(InvalidArgument, match=r"uniqueItems"):
        engine.compile(Constraint("json_schema", json.dumps(schema)))
    with pytest.raises(InvalidArgument, match=r"\bif\b"):
        engine.compile(Constraint("json_schema", json.dumps({"anyOf": [{"type": "integer"}, {"if": {}}]})))
    engine.compile(Constraint("json_schema", json.dumps({"type": "object", "properties": {"not": {"type": "string"}}})))


def test_a_length_bounded_string_admits_no_raw_control_character(engine, tokenizer):
    """A raw control character is not JSON (xgrammar 0.2.9 let one into length-bounded strings,
    mlc-ai/xgrammar#800; docs/benchmarks/constraints.md)."""
    constraint = Constraint("json_schema", json.dumps({"type": "string", "minLength": 1, "maxLength": 3}))
    control = tokenizer.encode("\x01")
    matcher = engine.matcher(constraint)
    walk(matcher, tokenizer, '"')
    assert not all(matcher.accept(t) for t in control)
    matcher = engine.matcher(constraint)
    walk(matcher, tokenizer, '"ab"')
    assert EOS in allowed(matcher)
    matcher = engine.matcher(constraint)
    walk(matcher, tokenizer, '"')
    assert tokenizer.encode('"')[0] not in allowed(matcher)  # minLength 1


def test_prepare_compiles_off_the_calling_thread_once_and_hands_the_pass_its_grammars(tokenizer, monkeypatch):
    """SessionGrammars.prepare: each new constraint compiled once on another thread (at the lowest priority)
    however many wait on it, and returned, compiled or with its error; ``at`` builds a matcher from what it was
    handed and never compiles: a constraint evicted from the cache after prepare is still served from the
    grammar the caller holds, one neither prepared nor cached is Aborted, and one that does not compile
    raises its error at ``at``."""
    import asyncio
    import os
    import threading

    from specserve.api.errors import Aborted
    from specserve.engine.grammar import PREPARE_NICE, SessionGrammars

    grammars = SessionGrammars(tokenizer, VOCAB, [EOS], max_sessions=4, cache_size=1)
    threads: list[str] = []
    nice: list[int] = []
    real = GrammarEngine.compile

    def recording(self, constraint):
        threads.append(threading.current_thread().name)
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(self, constraint)

    monkeypatch.setattr(GrammarEngine, "compile", recording)
    good, bad = Constraint("regex", "[ab]{2,4}"), Constraint("regex", "(unclosed")
    assert not grammars.ready(good)

    async def main():
        return await asyncio.gather(grammars.prepare([good, bad]), grammars.prepare([good]))

    first, second = asyncio.run(main())
    assert grammars.ready(good) and not grammars.ready(bad)
    assert len(threads) == 2 and threading.current_thread().name not in threads  # good once, bad once
    assert nice == [PREPARE_NICE] * 2
    assert first[good] is second[good] and isinstance(first[bad], InvalidArgument)
    compiles = len(threads)
    assert grammars.at("s", good, tokenizer.encode("ab"), first[good]).tokens == tuple(tokenizer.encode("ab"))
    other = Constraint("choice", ("x",))
    asyncio.run(grammars.prepare([other]))  # another call's compile evicts it between prepare and the pass
    assert not grammars.ready(good)
    assert grammars.at("s2", good, tokenizer.encode("a"), first[good]).tokens == tuple(tokenizer.encode("a"))
    with pytest.raises(Aborted, match="was not compiled before the pass"):
        grammars.at("s3", good, [])  # neither handed nor cached: refused, not compiled on the pass's thread
    with pytest.raises(InvalidArgument, match="does not compile"):
        grammars.at("t", bad, [], first[bad])
    assert len(threads) == compiles + 1  # ``other``'s: no compile in the pass
    grammars.close()
