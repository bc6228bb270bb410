"""Every constrained output through the system is valid (issue 41, "Validity"): the whole validity set.

The set is tests/data/constraints (:func:`benchmarks.constraints.load_set`): at least 30 JSON
schemas of varied shape, 10 regexes and 5 choice lists. Each goes through the whole system (real Redis,
gRPC target, draft and coordinator, the tiny float32 pair) greedy and at T = 0.7, with the model
draft, the n-gram proposer and the adaptive policy (gamma left to the server). The tiny models write
garbage, but under the target's mask a generation that stops must be valid. For JSON that means
Python's strict ``json.loads`` parses it and ``jsonschema`` validates it. For a regex ``re.fullmatch``
must match it, and for a choice it must be one of the strings.

``max_new_tokens`` is above the longest output the set's constraints allow on the tiny tokenizer, so
every generation should stop with EOS where its constraint is complete. A generation that ends with
``length`` is counted and reported, not hidden. More than :data:`MAX_LENGTH_FINISHES` of them per run
fails the test, so validity cannot pass by running out of tokens.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import system_fixtures as sf

from benchmarks.constraints import Case, load_set
from specserve.api.constraints import Constraint
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SET = Path(__file__).resolve().parents[2] / "data" / "constraints"
#: Above the longest output any constraint of the set allows on the tiny tokenizer (every string,
#: array and number in the set's schemas is bounded).
MAX_NEW = 320
#: Generations per run (of about 50) allowed to end with ``length``.
MAX_LENGTH_FINISHES = 2
#: Generations in flight at once (below the stack's sessions per client).
CONCURRENCY = 6

MODES = {
    "model": {"proposer": common_pb2.PROPOSER_KIND_MODEL, "gamma": 4},
    "ngram": {"proposer": common_pb2.PROPOSER_KIND_NGRAM, "gamma": 4},
    "adaptive": {"proposer": common_pb2.PROPOSER_KIND_MODEL, "gamma": None},
}


def _constraint(case: Case) -> Constraint:
    if case.kind == "json_schema":
        return Constraint("json_schema", json.dumps(case.value))
    if case.kind == "regex":
        return Constraint("regex", case.value)
    return Constraint("choice", tuple(case.value))


async def _run(
    stack, tokenizer, case: Case, mode: str, temperature: float, seed: int, gate: asyncio.Semaphore
):
    req = sf.request(
        "Reply with the answer:\n", max_new_tokens=MAX_NEW, temperature=temperature, seed=seed, **MODES[mode]
    )
    req.sampling.constraint.CopyFrom(_constraint(case).to_pb())
    async with gate:
        out = await sf.generate(stack.address, req, timeout_s=300.0)
    assert out.stats is not None, case.name
    # The streamed text is the completion's tokens decoded without EOS.
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True), case.name
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "t0.7"])
@pytest.mark.parametrize("mode", list(MODES))
async def test_every_output_of_the_validity_set_is_valid(stack, pair, mode, temperature, record_property):
    cases = load_set(SET)
    tokenizer = pair.tokenizer
    gate = asyncio.Semaphore(CONCURRENCY)
    outs = await asyncio.gather(
        *(_run(stack, tokenizer, case, mode, temperature, seed, gate) for seed, case in enumerate(cases))
    )
    invalid, lengths = [], []
    for case, out in zip(cases, outs, strict=True):
        reason = out.stats.finish_reason
        if reason == common_pb2.FINISH_REASON_LENGTH:
            lengths.append(case.name)
            continue
        assert reason == common_pb2.FINISH_REASON_EOS, (case.name, reason)
        if not case.valid(out.text):
            invalid.append((case.kind, case.name, out.text))
    record_property("length_finishes", lengths)
    print(
        f"{mode} T={temperature}: {len(cases) - len(lengths)} of {len(cases)} stopped, ended by length: {lengths}"
    )
    assert not invalid, invalid
    assert len(lengths) <= MAX_LENGTH_FINISHES, lengths
