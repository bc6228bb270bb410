"""The hybrid lookup (``HybridLookup``, a source with a tracker of its own): a session drafting with the model under the
adaptive policy drafts copied text from an n-gram lookup over its own tokens, with no draft call, and leaves
the rest to the draft model and the target.

Two halves:

* The round loop's decisions against :class:`ScriptedPool`, a stand-in for ``WorkerPool`` named as such: its
  "target" commits a fixed script of tokens (greedy: a proposed token is accepted when it is the script's
  next one, then the script's next token is committed as the correction or bonus), its "draft model"
  proposes tokens that are always wrong, and its costs are those of a CPU-like pair (a pass over k
  positions costs more than a step, a draft token 15% of a step), fed to a real ``CostModel``. Scripts
  that copy the prompt, and scripts whose lookup keeps guessing wrong, show where the lookup drafts and
  where it does not, with the policy, trackers and session all real.
* The whole system (real Redis, gRPC servers on loopback, the tiny float32 pair): greedy output is the
  target's own with the hybrid lookup on and off, and in the coupled sampling mode a seed gives the same
  text either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
import pytest_asyncio
import system_fixtures as sf
from worker_fakes import round_loop

from specserve import AsyncClient
from specserve.api.params import SamplingParams, StopConditions, Verdict
from specserve.coordinator.coordinator import generation_stats
from specserve.coordinator.messages import NO_PROPOSAL, CallCost, Proposal, Verified
from specserve.coordinator.requests import SpeculationSettings
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.acceptance import AcceptanceMemory
from specserve.coordinator.speculation.cost_model import CostModel
from specserve.coordinator.speculation.policy import AdaptiveGamma, FixedGamma, LoadSnapshot
from specserve.coordinator.speculation.sources.ngram import HybridLookup
from specserve.v1 import common_pb2

STEP_NS = 20_000_000  # a target step
DRAFT_TOKEN_NS = 3_000_000  # a draft token: 15% of a step
RTT_NS = 500_000
MODEL = SpeculationSettings(gamma=None, proposer=common_pb2.PROPOSER_KIND_MODEL, hybrid_lookup=True)


def pass_ns(positions: int) -> int:
    """A verify pass over ``positions`` positions: a CPU-like curve (9 positions cost 1.8 steps)."""
    return int(STEP_NS * (1 + 0.1 * (positions - 1)))


class ScriptedPool:
    """A stand-in for ``WorkerPool`` (the methods ``RoundLoop`` calls), named as such; see the module docstring."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.cost_model = CostModel()
        for k in range(1, 10):  # what the coordinator would have learnt from earlier calls
            self.cost_model.observe_verify(batch_size=1, positions=k, ns=pass_ns(k))
            self.cost_model.observe_draft(tokens=k, ns=k * DRAFT_TOKEN_NS)
            self.cost_model.observe_rtt(ns=RTT_NS)
        self.model_calls = 0

    # -- what RoundLoop and the speculator call
    def attach(self, session: Session) -> None:
        pass

    def load(self) -> LoadSnapshot:
        return LoadSnapshot.idle()

    def bind_round(self, session: Session) -> None:
        pass

    async def propose(self, session, gamma, *, features=None) -> Proposal:
        if gamma == 0:
            return NO_PROPOSAL
        self.model_calls += 1
        done = session.committed_len - session.prompt_len
        wrong = tuple(self.script[done + i] + 1 for i in range(gamma))  # never the script's token
        return Proposal(wrong, wall_ns=gamma * DRAFT_TOKEN_NS + RTT_NS, draft_ns=gamma * DRAFT_TOKEN_NS)

    async def verify(self, session, item, *, drafted: bool = False) -> Verified:
        done = session.committed_len - session.prompt_len
        left = session.stop.max_new_tokens - done
        proposal = list(item.proposal.token_ids)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == self.script[done + accepted]:
            accepted += 1
        count = accepted + 1 if proposal else max(1, item.decode_steps)
        committed = tuple(self.script[done : done + min(count, left)])
        finish = common_pb2.FINISH_REASON_LENGTH if len(committed) == left else 0
        verdict = Verdict(
            accepted_count=min(accepted, len(committed)),
            committed_token_ids=committed,
            bonus=accepted == len(proposal) > 0,
            new_version=session.version + 1,
            committed_len=session.committed_len + len(committed),
            finish_reason=finish,
        )
        positions = len(proposal) + 1
        ns = pass_ns(positions) * (1 if proposal else count)
        self.cost_model.observe_verify(batch_size=1, positions=positions, ns=ns)
        return Verified(
            item, verdict, cost=CallCost(call_ns=ns + RTT_NS, verify_ns=ns, batch_size=1, positions_processed=positions)
        )

    def detach(self, session: Session) -> None:
        pass


class PooledMemory(AcceptanceMemory):
    """The acceptance pooled across sessions, with a record of what each round fed it."""

    def __init__(self) -> None:
        super().__init__()
        self.pooled: list[tuple[int, int]] = []  # (proposed, accepted)

    def observe(self, key: str, *, proposed: int, accepted: int) -> None:
        self.pooled.append((proposed, accepted))
        super().observe(key, proposed=proposed, accepted=accepted)


async def run_session(prompt: list[int], script: list[int], *, lookup: bool = True, max_new: int = 48):
    """One greedy session through a real ``RoundLoop`` and ``AdaptiveGamma`` on a ``ScriptedPool``."""
    pool = ScriptedPool(script)
    session = Session(
        uuid.uuid4().hex,
        prompt,
        SamplingParams(temperature=0.0),
        StopConditions(max_new_tokens=max_new, ignore_eos=True),
        dataclasses.replace(MODEL, hybrid_lookup=lookup),
    )
    policy = AdaptiveGamma.up_to(pool.cost_model, 16, decode_steps=4)
    memory = PooledMemory()
    loop = round_loop(session, pool=pool, store=None, policy=policy, max_gamma=16, memory=memory, decode_steps=4)
    out: list[int] = []
    while not session.finished:
        out.extend((await loop.step()).token_ids)
    assert out == script[:max_new], "every round commits the script's tokens, in order"
    run_session.last_loop = loop  # for the tests that look at the trackers
    pool.pooled = memory.pooled
    return generation_stats(session), pool


def copied_prompt() -> tuple[list[int], list[int]]:
    """A prompt of 64 distinct tokens, and a completion that copies it (a file continued or quoted)."""
    prompt = list(range(100, 164))
    return prompt, prompt + prompt


@pytest.mark.unit
def test_copied_text_is_drafted_from_the_lookup_with_no_draft_call():
    prompt, script = copied_prompt()
    stats, pool = asyncio.run(run_session(prompt, script))
    assert stats.lookup_proposed_tokens > 0, "no round was drafted from the lookup"
    # The first rounds run without it (the prefill's token, then one round of 4 target steps, in whose
    # tokens its guesses are first seen to match); from there on the copy is drafted from the lookup.
    assert stats.lookup_accepted_tokens >= 0.7 * stats.completion_tokens, stats
    assert stats.rounds <= 8, f"copied runs are verified many tokens per pass: {stats.rounds} rounds for 48"
    assert pool.model_calls <= 2, "the draft model, whose tokens are all rejected, is left alone"
    # Only the draft model's rounds feed the acceptance pooled across its sessions.
    model_proposed = stats.proposed_tokens - stats.lookup_proposed_tokens
    assert sum(p for p, _ in pool.pooled) == model_proposed


@pytest.mark.unit
def test_the_same_session_without_the_lookup_gets_no_copy_speedup():
    prompt, script = copied_prompt()
    with_lookup, _ = asyncio.run(run_session(prompt, script))
    stats, _ = asyncio.run(run_session(prompt, script, lookup=False))
    assert stats.lookup_proposed_tokens == 0
    assert stats.rounds >= 12, "at best decode_steps (4) tokens per round: the target alone"
    assert stats.rounds > 2 * with_lookup.rounds


@pytest.mark.unit
def test_a_lookup_that_keeps_guessing_wrong_is_left_alone():
    """The prompt repeats a motif, so the lookup always has a match; the completion never follows it. The
    lookup learns that from the rounds it does not draft (its guess against the committed tokens, for free)
    and never drafts: the session runs at the target's pace, 4 steps per Verify call. (The script opens
    with a token the lookup does not guess: after the prompt's last 10 it guesses 7, and one right guess
    would be a match seen, after which a gamma-0 round priced at its 4 passes loses to a lookup round.)"""
    motif = [7, 8, 9, 10]
    prompt = motif * 8
    script = [t for i in range(24) for t in (200 + i, 7)]  # after every 7 the lookup guesses 8: wrong
    stats, _ = asyncio.run(run_session(prompt, script))
    assert stats.lookup_proposed_tokens == 0, (
        f"the lookup, never seen to match, drafted {stats.lookup_proposed_tokens} tokens"
    )
    assert stats.rounds <= 20, f"{stats.rounds} rounds for 48 tokens: the lookup kept the target from 4 steps"
    # It learnt that from the rounds it did not draft: its acceptance is the one its guesses had there.
    lookup_alpha = run_session.last_loop.speculator.source("ngram").tracker.alpha()
    assert lookup_alpha < 0.4, f"the lookup's acceptance estimate {lookup_alpha:.2f} did not learn its misses"


@pytest.mark.unit
def test_only_a_model_session_without_a_prediction_keeps_a_hybrid_lookup():
    """(A fixed gamma turns it off where the request is parsed: the system test below.)"""

    def ngram_source(speculation: SpeculationSettings, prediction=None):
        session = Session("s", [1, 2], SamplingParams(), StopConditions(), speculation)
        loop = round_loop(session, pool=ScriptedPool([]), store=None, policy=FixedGamma(0), prediction=prediction)
        return loop.speculator.source("ngram")

    ngram = SpeculationSettings(gamma=None, proposer=common_pb2.PROPOSER_KIND_NGRAM, hybrid_lookup=True)
    assert isinstance(ngram_source(MODEL), HybridLookup)
    assert not isinstance(ngram_source(ngram), HybridLookup), "the ngram session's own lookup, not a hybrid one"
    assert ngram_source(MODEL, prediction=[1]) is None
    assert ngram_source(dataclasses.replace(MODEL, hybrid_lookup=False)) is None


# ---- the whole system ------------------------------------------------------------------------------------

MAX_NEW = 64
MAX_GAMMA = 4
# The tiny target's greedy continuations of the first three fall into loops (a token repeated, then another
# after a break), which the lookup matches and drafts from once seen to match; the fourth never repeats.
PROMPTS = ([142] * 8, [160] * 8, [31] * 8, [5, 17, 42, 9, 5, 17, 42])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    """The whole system with gamma capped at MAX_GAMMA. Whether the lookup's acceptance pays for a round is the
    policy's call on costs timed on this machine, but its probe clock is not: the lookup drafts within any 9
    rounds in which it is ready (8 at gamma 0, then a probe). A round commits at most MAX_GAMMA + 1 tokens, so a
    looping continuation of MAX_NEW tokens gives it well over 9 such rounds on any machine."""
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides={"max_gamma": MAX_GAMMA}) as s:
        yield s


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_output_is_the_targets_with_the_hybrid_lookup_on_and_off(stack, pair):
    async with AsyncClient(stack.address) as client:
        lookup_drafted = 0
        for prompt in PROMPTS:
            want = sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
            kw = {"prompt_token_ids": prompt, "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
            on = await client.generate(**kw)
            off = await client.generate(hybrid_lookup=False, **kw)
            fixed = await client.generate(gamma=2, hybrid_lookup=True, **kw)
            assert list(on.token_ids) == list(off.token_ids) == list(fixed.token_ids) == want
            assert off.stats.lookup_proposed_tokens == 0
            assert fixed.stats.lookup_proposed_tokens == 0, "a fixed gamma drafts with the model only"
            assert on.stats.lookup_accepted_tokens <= on.stats.lookup_proposed_tokens <= on.stats.proposed_tokens
            lookup_drafted += on.stats.lookup_proposed_tokens
        # The looping continuations give the lookup matches and, with the probe clock, rounds (the module's
        # stack): it must have drafted (and been verified) somewhere, or this test checked nothing about it.
        assert lookup_drafted > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_in_the_coupled_mode_a_seed_gives_the_same_text_with_the_lookup_on_and_off(stack):
    async with AsyncClient(stack.address) as client:
        for seed, prompt in enumerate(PROMPTS):
            kw = {
                "prompt_token_ids": prompt,
                "max_new_tokens": MAX_NEW,
                "temperature": 0.9,
                "seed": 100 + seed,
                "sampling_mode": "coupled",
                "ignore_eos": True,
            }
            on = await client.generate(**kw)
            off = await client.generate(hybrid_lookup=False, **kw)
            assert list(on.token_ids) == list(off.token_ids)
