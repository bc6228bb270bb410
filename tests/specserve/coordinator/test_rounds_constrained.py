"""Constrained decoding through the whole system: real Redis, real gRPC target / draft / coordinator servers,
tiny float32 models with a real byte-level BPE tokenizer (docs/design.md, "Constrained decoding").

* Greedy: for a JSON schema with long fixed keys, a regex and a choice, with the model draft (gamma 3 and
  the adaptive policy) and the n-gram proposer (gamma 3 and adaptive), the streamed ids equal target-alone
  constrained decoding, Hugging Face ``generate(do_sample=False)`` with a logits processor masking with the
  same engine (``specserve.engine.grammar.GrammarLogitsProcessor``); with a fixed gamma the JSON schema's
  keys are drafted as forced text (no draft call) and accepted.
* Distribution at T = 0.7: N = 480 seeded sessions under a choice of five strings (many tokenisations of
  each), through the real stack with the model draft at gamma 2 and the forced-text proposer; the joint
  of the completion's tokens is compared with the masked target distribution computed by enumeration
  (each prefix's target logits masked by the grammar there, then ``logits_to_probs``) by a Pearson
  chi-square test, cells of expected count < 5 merged, alpha = 0.001. It passes with a draft that does not
  mask q as well (exactness does not depend on the draft's mask), and rejects a target that does not mask
  p (the draft alone masks q): that samples outside the grammar.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch

import specserve.target.verifier
from specserve.api.constraints import Constraint
from specserve.api.params import SamplingParams
from specserve.core.sampling import logits_to_probs
from specserve.engine.grammar import GrammarEngine, apply_masks
from specserve.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

EOS = 0
MAX_NEW = 64
MODEL = common_pb2.PROPOSER_KIND_MODEL
NGRAM = common_pb2.PROPOSER_KIND_NGRAM
PROMPTS_TEXT = ("def add(a, b):\n", "the quick brown")

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 5},
        "order_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "is_priority_shipping": {"type": "boolean"},
    },
    "required": ["customer_full_name", "order_identifier", "is_priority_shipping"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "regex": Constraint("regex", r"(def|class) [a-z]{1,8}\((a|b|self)?\):"),
    "choice": Constraint("choice", ("def add", "class Point", "print(i)", "import os")),
}


def constrained_request(prompt, constraint: Constraint, **kwargs):
    req = sf.request(prompt, **kwargs)
    req.sampling.constraint.CopyFrom(constraint.to_pb())
    return req


def reference(pair, prompt, constraint: Constraint, max_new: int) -> list[int]:
    """Target-alone constrained greedy decoding, cut after the first EOS."""
    return sf.reference_constrained(pair, prompt, constraint, max_new, eos_token_id=EOS)


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode(t, add_special_tokens=False) for t in PROMPTS_TEXT]


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize(
    ("proposer", "gamma"), [(MODEL, 3), (MODEL, None), (NGRAM, 3), (NGRAM, None)], ids=["model-g3", "model-auto", "ngram-g3", "ngram-auto"]
)
async def test_greedy_constrained_output_is_target_alone_constrained_decoding(
    stack, pair, store, prompts, kind, proposer, gamma
):
    constraint = CONSTRAINTS[kind]
    outs = await asyncio.gather(
        *(
            sf.generate(
                stack.address,
                constrained_request(p, constraint, max_new_tokens=MAX_NEW, gamma=gamma, proposer=proposer),
            )
            for p in prompts
        )
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(pair, prompt, constraint, MAX_NEW)
        record = await store.load(out.stats.session_id)
        assert list(record.generated_token_ids) == out.token_ids
        if kind == "json_schema" and gamma is not None:
            # The keys are forced text: with a fixed gamma every round that has some drafts it in the
            # coordinator (the adaptive policy's choice depends on measured costs: not asserted).
            assert out.stats.forced_proposed_tokens >= len(pair.tokenizer.encode('"customer_full_name": "'))
            assert out.stats.forced_accepted_tokens > 0
        if kind == "json_schema":
            if out.stats.finish_reason == common_pb2.FINISH_REASON_EOS:
                json.loads(pair.tokenizer.decode(out.token_ids, skip_special_tokens=True))


# ---- the distribution at T = 0.7 -------------------------------------------------------------------------

N = 480
ALPHA = 0.001
CONCURRENCY = 64
CHOICE = Constraint("choice", ("yes", "no", "maybe", "x = 1", "import os"))
T = 0.7
DIST_PROMPT_TEXT = "def add(a, b):\n"


def masked_joint(pair, prompt, constraint: Constraint, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(completion) under target-alone constrained sampling, by enumeration: each prefix's next-token logits
    masked by the grammar there, processed by ``logits_to_probs``; a completion ends at EOS."""
    model = sf.load_reference(pair.target_dir)
    engine = GrammarEngine(pair.tokenizer, model.config.vocab_size, [EOS])
    done: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    while frontier:
        prefixes = list(frontier)
        ids = torch.tensor([list(prompt) + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1, :].float()  # [n_prefixes, vocab]
        masks = []
        for p in prefixes:
            matcher = engine.matcher(constraint)
            matcher.sync(p)
            masks.append(matcher.masks_along(()))
        probs = logits_to_probs(apply_masks(logits, torch.cat(masks)), params, None)  # [n_prefixes, vocab]
        nxt: dict[tuple[int, ...], float] = {}
        for i, p in enumerate(prefixes):
            for t in torch.nonzero(probs[i]).flatten().tolist():
                mass = frontier[p] * float(probs[i, t])
                (done if t == EOS else nxt)[(*p, t)] = mass
        frontier = nxt
    return done


async def sample_choice(stack, prompt) -> Counter:
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(seed: int) -> tuple[int, ...]:
        async with sem:
            req = constrained_request(prompt, CHOICE, max_new_tokens=16, temperature=T, seed=seed, gamma=2)
            return tuple((await sf.generate(stack.address, req)).token_ids)

    return Counter(await asyncio.gather(*(one(seed) for seed in range(N))))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def exact(pair):
    prompt = pair.tokenizer.encode(DIST_PROMPT_TEXT, add_special_tokens=False)
    joint = masked_joint(pair, prompt, CHOICE, SamplingParams(temperature=T))
    assert abs(sum(joint.values()) - 1.0) < 1e-6 and len(joint) > len(CHOICE.choices)  # several tokenisations
    return prompt, joint


async def test_the_joint_at_t07_is_the_masked_target_distribution(stack, exact):
    prompt, joint = exact
    forced_before = _forced_proposals()
    observed = await sample_choice(stack, prompt)
    outside = [seq for seq in observed if seq not in joint]
    assert not outside, f"sampled completions the masked target gives probability 0: {outside}"
    stat, p, cells = sf.merged_chi_square(observed, joint)
    print(f"chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"
    assert _forced_proposals() > forced_before  # the forced text drafted (e.g. "es" after "y")


async def test_an_unmasked_draft_keeps_the_joint(stack, exact, monkeypatch):
    """The draft's grammar switched off (its proposals leave the grammar and are rejected there): the same
    test passes, as exactness rests on the target's mask alone."""
    prompt, joint = exact
    proposer = stack.draft.engine.proposers[MODEL]
    monkeypatch.setattr(proposer, "grammars", None)
    observed = await sample_choice(stack, prompt)
    outside = [seq for seq in observed if seq not in joint]
    assert not outside, f"sampled completions the masked target gives probability 0: {outside}"
    stat, p, cells = sf.merged_chi_square(observed, joint)
    print(f"unmasked draft: chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"


async def test_the_same_test_rejects_a_target_that_does_not_mask_p(stack, exact, monkeypatch):
    """The biased variant: the target verifies with unmasked p while the draft still masks q (the mistake of
    a system that constrains only the drafter). Same seeds, same test: it fails."""
    prompt, joint = exact
    monkeypatch.setattr(specserve.target.verifier.Verifier, "_constrain", lambda self, w: None)
    observed = await sample_choice(stack, prompt)
    outside = sum(n for seq, n in observed.items() if seq not in joint)
    stat, p, cells = sf.merged_chi_square(observed, joint) if not outside else (float("inf"), 0.0, 0)
    print(f"unmasked p: {outside} of {N} outside the grammar; chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p < ALPHA


def _forced_proposals() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specserve_coordinator_proposals_total", {"proposer": "forced"}) or 0.0
