"""target_service.verifier with a constrained session: the grammar's mask on p at every verified position.

Greedy verdicts, round after round and whatever is proposed (nothing, an unmasked draft's greedy tokens,
tokens the grammar refuses), commit exactly Hugging Face ``generate()`` with a logits processor that masks
with the same engine; the matcher holds the committed tokens after a rejection and after a lost
compare-and-set, and a replica that never saw the session rebuilds it from the log.
"""

from __future__ import annotations

import json

import pytest
import torch
from target_helpers import greedy_continuation, make_verifier, new_session, verify_one
from transformers import LogitsProcessorList

from specserve.api.constraints import Constraint
from specserve.api.params import SamplingParams, StopConditions
from specserve.engine.grammar import GrammarEngine, GrammarLogitsProcessor
from specserve.engine.models import LoadedModel

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
