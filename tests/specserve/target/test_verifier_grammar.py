"""specserve.target.verifier with a constrained session: the grammar's mask on p at every verified position.

Greedy verdicts, round after round and whatever is proposed (nothing, an unmasked draft's greedy tokens,
tokens the grammar refuses), and several target steps per call, commit exactly Hugging Face ``generate()``
with a logits processor that masks with the same engine; coupled verdicts are Gumbel-max of the masked
target; the matcher holds the committed tokens after a rejection and after a lost compare-and-set, and a
replica that never saw the session rebuilds it from the log.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from target_helpers import fresh_logits, greedy_continuation, item, make_verifier, new_session, verify_one
from transformers import LogitsProcessorList

from specserve.api.constraints import Constraint
from specserve.api.params import SamplingParams, StopConditions, Verdict
from specserve.core.rng import gumbel_noise
from specserve.core.sampling import logits_to_probs
from specserve.engine.grammar import GrammarEngine, GrammarLogitsProcessor, apply_masks
from specserve.engine.models import LoadedModel
from specserve.target.messages import VerifyBatch

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11)
EOS = 0

CONSTRAINTS = {
    "choice": Constraint("choice", ("def add", "class Point", "print(i)", "import os")),
    "regex": Constraint("regex", r"(def|class) [a-z]{1,8}\((a|b|self)?\):"),
    "json_schema": Constraint(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "n": {"type": "integer", "minimum": 0, "maximum": 99},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "n", "ok"],
                "additionalProperties": False,
            }
        ),
    ),
}


def reference(model: LoadedModel, prompt, constraint: Constraint, n_new: int, penalty: float = 1.0) -> list[int]:
    """Target-alone constrained greedy decoding: ``generate(do_sample=False)`` with the engine's processor,
    cut after the first EOS."""
    engine = GrammarEngine(model.tokenizer, model.vocab_size, [EOS])
    processor = GrammarLogitsProcessor(engine, constraint, len(prompt))
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n_new,
            repetition_penalty=penalty,
            eos_token_id=EOS,
            pad_token_id=EOS,
            logits_processor=LogitsProcessorList([processor]),
        )[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize(("proposer", "penalty"), [("none", 1.0), ("draft", 1.0), ("wrong", 1.3)])
async def test_greedy_constrained_chain_is_target_alone_constrained_decoding(
    target, draft, store, kind, proposer, penalty
):
    """gamma = 0 rounds, an unmasked draft's greedy proposals, or proposals whose second token is wrong (often
    outside the grammar): the log is ``generate()`` with the grammar's logits processor, token for token."""
    n_new = 24
    constraint = CONSTRAINTS[kind]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty, constraint=constraint)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=n_new))
    while not record.finished:
        tokens: list[int] = []
        if proposer == "draft":
            tokens = greedy_continuation(draft, record.token_ids, 3)
        elif proposer == "wrong":
            tokens = greedy_continuation(target, record.token_ids, 3)
            tokens[1] = (tokens[1] + 7) % target.vocab_size
        result = await verify_one(verifier, record, tokens)
        assert result.error is None, result.error
        record = await store.load(record.session_id)
        if not record.finished:  # the matcher holds exactly the committed tokens after every round
            assert verifier.grammars.held(record.session_id) == record.generated_token_ids
    expected = reference(target, PROMPT, constraint, n_new, penalty)
    assert list(record.generated_token_ids) == expected
    matcher = GrammarEngine(target.tokenizer, target.vocab_size, [EOS]).matcher(constraint)
    matcher.sync(expected)  # every committed token satisfies the grammar
    verifier.close()


async def test_a_replica_that_never_saw_the_session_rebuilds_the_matcher_from_the_log(target, draft, store):
    """Rounds alternate between two replicas (each sees every other round, its matcher behind the log): the
    log is target-alone constrained decoding all the same."""
    constraint = CONSTRAINTS["json_schema"]
    params = SamplingParams(temperature=0.0, constraint=constraint)
    replicas = [make_verifier(target, store), make_verifier(target, store)]
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=24))
    rounds = 0
    while not record.finished:
        verifier = replicas[rounds % 2]
        result = await verify_one(verifier, record, greedy_continuation(draft, record.token_ids, 2))
        assert result.error is None, result.error
        record = await store.load(record.session_id)
        rounds += 1
    assert rounds >= 3
    assert list(record.generated_token_ids) == reference(target, PROMPT, constraint, 24)
    for verifier in replicas:
        verifier.close()


async def test_eos_is_allowed_only_where_the_grammar_is_complete(target, store):
    """A proposal of EOS before the choice is complete is rejected (p(EOS) = 0 there), however sure q is."""
    constraint = Constraint("choice", ("import os",))
    params = SamplingParams(temperature=0.7, seed=5, constraint=constraint)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=24))
    q = torch.zeros(1, target.vocab_size, dtype=torch.float64)
    q[0, EOS] = 1.0
    result = await verify_one(verifier, record, [EOS], q)
    assert result.verdict.accepted_count == 0 and result.verdict.committed_token_ids[0] != EOS
    while not record.finished:
        record = await store.load(record.session_id)
        if record.finished:
            break
        assert (await verify_one(verifier, record)).error is None
    assert target.tokenizer.decode(record.generated_token_ids) == "import os<|endoftext|>"
    verifier.close()


async def test_several_target_steps_in_one_call_follow_the_grammar(target, store):
    """gamma = 0 items asking for 4 target steps per call (``decode_steps``): each step masks with the state
    the steps before it left; the log is target-alone constrained decoding."""
    constraint = CONSTRAINTS["json_schema"]
    params = SamplingParams(temperature=0.0, constraint=constraint)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=24))
    while not record.finished:
        result = await verifier.verify(VerifyBatch(items=(dataclasses.replace(item(record), decode_steps=4),)))
        assert result.results[0].error is None
        record = await store.load(record.session_id)
    assert list(record.generated_token_ids) == reference(target, PROMPT, constraint, 24)
    verifier.close()


async def test_coupled_constrained_tokens_are_gumbel_max_of_the_masked_target(target, draft, store):
    """The coupled mode under a grammar: every committed token is ``argmax(log p_j + G_j)`` of the target's
    masked distribution (fresh prefills, the grammar's mask at the prefix, noise of (seed, j)), whatever the
    unmasked draft proposed."""
    constraint = CONSTRAINTS["regex"]
    params = SamplingParams(temperature=0.9, seed=13, sampling_mode="coupled", constraint=constraint)
    engine = GrammarEngine(target.tokenizer, target.vocab_size, [EOS])
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=20))

    def masked_gumbel(seq) -> int:
        matcher = engine.matcher(constraint)
        matcher.sync(seq[len(PROMPT) :])
        logits = apply_masks(fresh_logits(target, seq)[-1:].clone(), matcher.masks_along(()))
        probs = logits_to_probs(logits, params, None)[0]
        return int(torch.argmax(probs.log() + gumbel_noise([params.seed], [len(seq)], target.vocab_size)[0]))

    while not record.finished:
        proposal = greedy_continuation(draft, record.token_ids, 3)
        result = await verify_one(verifier, record, proposal)
        assert result.error is None, result.error
        seq = list(record.token_ids)
        for token in result.verdict.committed_token_ids:
            assert token == masked_gumbel(seq)
            seq.append(token)
        record = await store.load(record.session_id)
    engine.matcher(constraint).sync(record.generated_token_ids)
    verifier.close()


class RivalStore:
    """The session store with a rival writer that commits the target-alone constrained token first, once."""

    def __init__(self, store, token: int):
        self._store = store
        self.token = token

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def commit(self, session_id, base_version, verdict):
        if self.token is not None:
            length = verdict.committed_len - len(verdict.committed_token_ids)
            rival = Verdict(
                accepted_count=0,
                committed_token_ids=(self.token,),
                bonus=False,
                new_version=base_version + 1,
                committed_len=length + 1,
            )
            self.token = None
            await self._store.commit(session_id, base_version, rival)
        return await self._store.commit(session_id, base_version, verdict)


async def test_a_lost_compare_and_set_rolls_the_matcher_back_to_the_log(target, store):
    """Another writer commits first (ours comes back as a replay of its verdict): this replica's matcher,
    advanced optimistically by its own verdict, goes back to the prefix the round started from (as its
    cache does), and the next rounds, which bring it to the log, are target-alone constrained decoding."""
    constraint = CONSTRAINTS["json_schema"]
    params = SamplingParams(temperature=0.0, constraint=constraint)
    expected = reference(target, PROMPT, constraint, 24)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=24))
    verifier = make_verifier(target, RivalStore(store, expected[0]))
    wrong = [(expected[0] + 1) % target.vocab_size] * 2  # rejected: our verdict commits expected[0] too, late
    result = await verify_one(verifier, record, wrong)
    assert result.replayed
    assert verifier.grammars.held(record.session_id) == ()  # rolled back: our own verdict was not committed
    record = await store.load(record.session_id)
    assert record.generated_token_ids == (expected[0],)
    verifier.store = store
    while not record.finished:
        assert (await verify_one(verifier, record, greedy_continuation(target, record.token_ids, 2))).error is None
        record = await store.load(record.session_id)
    assert list(record.generated_token_ids) == expected
    verifier.close()


async def test_a_grammar_evicted_between_prepare_and_the_pass_is_not_compiled_under_the_batch_lock(
    target, store, monkeypatch
):
    """Other calls' compiles evict the session's grammar from the engine's cache after this call prepared it
    (``_prepare_grammars``) and before its pass: the pass builds the matcher from the grammar the call holds,
    and no compile runs on the model thread (under the batch lock) on a miss. Before, the pass compiled it
    again there, holding up every batch."""
    import threading

    from specserve.engine.grammar import DEFAULT_CACHE_SIZE, SessionGrammars

    constraint = Constraint("regex", r"(def|class) [a-z]{1,6}")
    on_model_thread: list[Constraint] = []
    real_compile = GrammarEngine.compile

    def recording(self, c):
        if threading.current_thread().name.startswith("target-model"):
            on_model_thread.append(c)
        return real_compile(self, c)

    real_prepare = SessionGrammars.prepare

    async def prepare_then_evict(self, constraints):
        prepared = await real_prepare(self, constraints)
        for i in range(DEFAULT_CACHE_SIZE):  # what other calls' compiles do meanwhile
            self.engine.compile(Constraint("choice", (f"other{i}",)))
        assert not self.ready(constraint)
        return prepared

    monkeypatch.setattr(GrammarEngine, "compile", recording)
    monkeypatch.setattr(SessionGrammars, "prepare", prepare_then_evict)
    verifier = make_verifier(target, store)
    params = SamplingParams(temperature=0.0, constraint=constraint)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=6))
    result = await verify_one(verifier, record)
    assert result.error is None, result.error
    assert on_model_thread == [], "compiled on the model thread, under the batch lock"
    monkeypatch.undo()
    record = await store.load(record.session_id)
    assert list(record.generated_token_ids) == reference(target, PROMPT, constraint, 6)[: len(record.generated_token_ids)]
    verifier.close()
