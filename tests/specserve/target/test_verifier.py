"""specserve.target.verifier: batched verification and commit against real tiny models and a real Redis.

Every test runs on a tiny Llama (RoPE, grouped-query attention) and a tiny GPT-2
(learned positions) target in float32; reference values come from fresh
prefills without any cache.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from target_helpers import (
    GREEDY,
    NAN_AT,
    assert_cache_holds,
    fresh_logits,
    greedy_continuation,
    hf_logprobs,
    item,
    make_verifier,
    new_session,
    next_probs,
    verify_one,
)

from specserve.api.errors import NotFound, SessionFinished, VersionConflict
from specserve.api.params import SamplingParams, StopConditions, Verdict
from specserve.core.proposal import DraftProposal
from specserve.core.rng import gumbel_noise
from specserve.core.sampling import logits_to_probs
from specserve.core.verification import verify_batch
from specserve.target.messages import VerifyBatch
from specserve.v1 import common_pb2

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11)
GAMMA = 5


def wrong(token: int, vocab_size: int) -> int:
    return (token + 1) % vocab_size


@pytest.mark.parametrize("reject_at", [0, 2, GAMMA - 1, None], ids=["first", "middle", "last", "none"])
async def test_forced_greedy_rejection_leaves_tokens_cache_and_log_in_agreement(target, store, reject_at):
    """Proposals follow the target's own argmax, then one wrong token at ``reject_at``: that many are accepted,
    the correction is the target's argmax, and the verdict, the Redis log and the cache all agree."""
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT)
    chain = greedy_continuation(target, PROMPT, GAMMA + 1)
    proposal = list(chain[:GAMMA])
    if reject_at is not None:
        proposal[reject_at] = wrong(chain[reject_at], target.vocab_size)
    result = await verify_one(verifier, record, proposal)
    assert result.error is None and not result.replayed
    verdict = result.verdict
    accepted = GAMMA if reject_at is None else reject_at
    assert verdict.accepted_count == accepted
    assert verdict.bonus == (reject_at is None)
    assert verdict.committed_token_ids == tuple(chain[: accepted + 1])
    assert (verdict.new_version, verdict.committed_len) == (1, len(PROMPT) + accepted + 1)
    committed = PROMPT + tuple(chain[: accepted + 1])
    assert await store.read_tokens(record.session_id) == committed
    assert_cache_holds(verifier, record.session_id, committed)
    # The next round (a plain decode step) continues exactly as target-only decoding.
    nxt = await verify_one(verifier, await store.load(record.session_id))
    assert nxt.verdict.committed_token_ids == tuple(greedy_continuation(target, committed, 1))
    assert_cache_holds(verifier, record.session_id, committed + nxt.verdict.committed_token_ids)
    verifier.close()


async def test_forced_sampled_rejection_at_a_token_outside_top_k(target, store):
    """Sampled (top-k) session: tokens proposed with q = p are accepted surely (ratio 1), a token outside the
    target's top-k (p = 0) is rejected surely; the correction comes from the residual, so lies in the top-k."""
    params = SamplingParams(temperature=0.8, top_k=8, seed=1234)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)
    seq, probs, tokens = list(PROMPT), [], []
    for i in range(4):
        p = next_probs(target, seq, params)  # [vocab] float64
        if i == 2:  # the rejection point: a token the target can never sample, proposed from a uniform q
            token = int(torch.nonzero(p == 0)[0])
            q = torch.full_like(p, 1.0 / p.numel())
        else:
            token = int(p.argmax())
            q = torch.full_like(p, 0.5 * (1 - float(p[token]) / 2) / (p.numel() - 1))
            q = q + 0.5 * p
            q[token] = float(p[token]) / 2  # p(x) / q(x) = 2: accepted whatever the uniform
            q = q / q.sum()
        tokens.append(token)
        probs.append(q)
        seq.append(token)
    result = await verify_one(verifier, record, tokens, torch.stack(probs))
    verdict = result.verdict
    assert verdict.accepted_count == 2 and not verdict.bonus
    assert verdict.committed_token_ids[:2] == tuple(tokens[:2])
    correction = verdict.committed_token_ids[2]
    p_reject = next_probs(target, list(PROMPT) + tokens[:2], params)
    assert p_reject[correction] > 0 and correction != tokens[2]
    committed = PROMPT + verdict.committed_token_ids
    assert await store.read_tokens(record.session_id) == committed
    assert_cache_holds(verifier, record.session_id, committed)
    verifier.close()


def draft_proposal(draft, committed, gamma, params, generator):
    """``gamma`` tokens sampled from the draft's processed distributions, and those distributions."""
    seq, tokens, rows = list(committed), [], []
    for _ in range(gamma):
        q = next_probs(draft, seq, params)  # [vocab] float64
        token = int(torch.multinomial(q, 1, generator=generator))
        tokens.append(token)
        rows.append(q)
        seq.append(token)
    return tokens, (torch.stack(rows) if rows else None)


def greedy_proposal(target, committed, gamma, reject_at):
    """The target's own argmax chain, with one wrong token at ``reject_at`` (None: all right)."""
    chain = greedy_continuation(target, committed, gamma)
    if reject_at is not None and reject_at < gamma:
        chain[reject_at] = wrong(chain[reject_at], target.vocab_size)
    return chain


@pytest.mark.parametrize("sessions", [1, 2])
async def test_a_lone_session_s_prompt_rides_in_its_verify_pass_and_a_batch_prefills_it_apart(
    target, store, sessions
):
    """A prompt longer than ``inline_catchup_max``: alone in a call, it is fed with the proposal in one
    forward pass (as target-only decoding's prefill, no extra pass); beside another session, each
    such prompt gets its own prefill pass first, so it pads no row of the batched pass. The verdicts
    are the target's greedy choices either way."""
    prompt = tuple(range(30, 50))  # 20 tokens
    verifier = make_verifier(target, store, inline_catchup_max=4)
    records = [await new_session(store, prompt) for _ in range(sessions)]
    chain = greedy_continuation(target, prompt, 3)
    passes = []
    hook = target.model.register_forward_hook(lambda _m, _a, _out: passes.append(1))
    try:
        result = await verifier.verify(VerifyBatch(items=tuple(item(r, chain[:2]) for r in records)))
    finally:
        hook.remove()
    assert len(passes) == (1 if sessions == 1 else sessions + 1)
    assert result.positions_processed == sessions * (len(prompt) + 2)
    for r, got in zip(records, result.results, strict=True):
        assert got.error is None and got.verdict.committed_token_ids == tuple(chain)
        assert_cache_holds(verifier, r.session_id, prompt + tuple(chain))


PROMPTS = ((7,), (5, 17, 42, 99, 3, 250, 7, 11, 9), tuple(range(30, 44)), (1, 2, 3, 1, 2, 3))
GAMMAS = ((0, 2, 5, 3), (4, 0, 1, 5), (2, 3, 0, 1))
REJECT = ((None, 1, 3, None), (0, None, None, 4), (1, None, None, 0))


@pytest.mark.parametrize(
    ("mode", "inline_catchup_max"),
    [("greedy", 32), ("sampled", 32), ("sampled", 2), ("coupled", 32)],
    ids=["greedy", "sampled", "sampled-separate-prefill", "coupled"],
)
async def test_batch_equals_each_session_verified_alone(target, draft, store, mode, inline_catchup_max):
    """Sessions with different prompt and proposal lengths, verified together in one padded pass, give row by
    row the verdicts and cache contents of each verified alone (fixed seeds), over three rounds."""
    params = (
        GREEDY
        if mode == "greedy"
        else SamplingParams(
            temperature=0.9,
            top_p=0.95,
            repetition_penalty=1.2,
            sampling_mode="coupled" if mode == "coupled" else "optimal",
        )
    )
    together = make_verifier(target, store, inline_catchup_max=inline_catchup_max)
    alone = make_verifier(target, store)
    gen = torch.Generator().manual_seed(7)
    twins = []
    for i, prompt in enumerate(PROMPTS):
        sampling = SamplingParams(**{**params.__dict__, "seed": 100 + i})
        twins.append([await new_session(store, prompt, sampling) for _ in range(2)])
    for rnd, gammas in enumerate(GAMMAS):
        items_batch, items_solo = [], []
        for i, (rec_b, rec_s) in enumerate(twins):
            assert rec_b.token_ids == rec_s.token_ids
            if mode == "greedy":
                tokens, probs = greedy_proposal(target, rec_b.token_ids, gammas[i], REJECT[rnd][i]), None
            else:
                tokens, probs = draft_proposal(draft, rec_b.token_ids, gammas[i], params, gen)
            items_batch.append(item(rec_b, tokens, probs))
            items_solo.append(item(rec_s, tokens, probs))
        batched = await together.verify(VerifyBatch(items=tuple(items_batch)))
        assert batched.positions_processed >= sum(g + 1 for g in gammas)
        for i, (rec_b, rec_s) in enumerate(twins):
            solo = (await alone.verify(VerifyBatch(items=(items_solo[i],)))).results[0]
            got = batched.results[i]
            assert got.session_id == rec_b.session_id and got.error is None and solo.error is None
            assert got.verdict == solo.verdict, f"round {rnd} session {i}"
            cache_b = together.caches.get(rec_b.session_id)
            cache_s = alone.caches.get(rec_s.session_id)
            assert (
                cache_b.tokens == cache_s.tokens == (rec_b.token_ids + got.verdict.committed_token_ids)[:-1]
            )
            for (kb, vb), (ks, vs) in zip(cache_b.layer_kv(), cache_s.layer_kv(), strict=True):
                torch.testing.assert_close(kb, ks, atol=1e-5, rtol=0)
                torch.testing.assert_close(vb, vs, atol=1e-5, rtol=0)
            twins[i] = [await store.load(rec_b.session_id), await store.load(rec_s.session_id)]
    if mode == "greedy":  # the forced rejections really happened where planned
        assert [r.verdict.accepted_count for r in batched.results] == [1, 3, 0, 0]
    for rec_b, _ in twins:
        assert_cache_holds(together, rec_b.session_id, rec_b.token_ids)
    together.close()
    alone.close()


def sure_accept_q(p: torch.Tensor, token: int) -> torch.Tensor:
    """A draft distribution with q(token) = p(token) / 2, so the token is accepted whatever the uniform."""
    q = torch.full_like(p, (1 - float(p[token]) / 2) / (p.numel() - 1))
    q[token] = float(p[token]) / 2
    return q / q.sum()


async def test_eos_inside_a_proposal_ends_the_commit(target, store):
    """A sampled proposal with the model's EOS third, every token surely accepted: the commit ends at EOS."""
    params = SamplingParams(temperature=1.0, seed=5)
    eos = target.eos_token_id
    assert eos is not None
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=50))
    seq, tokens, rows = list(PROMPT), [], []
    for i in range(5):
        p = next_probs(target, seq, params)
        token = eos if i == 2 else int(p.argmax())
        assert p[token] > 0
        tokens.append(token)
        rows.append(sure_accept_q(p, token))
        seq.append(token)
    verdict = (await verify_one(verifier, record, tokens, torch.stack(rows))).verdict
    assert verdict.committed_token_ids == tuple(tokens[:3])
    assert verdict.finish_reason == common_pb2.FINISH_REASON_EOS
    assert verdict.accepted_count == 3 and not verdict.bonus
    committed = PROMPT + tuple(tokens[:3])
    assert await store.read_tokens(record.session_id) == committed
    assert_cache_holds(verifier, record.session_id, committed)
    # A finished session takes no more rounds; its log stays as it is.
    again = await verify_one(verifier, await store.load(record.session_id), tokens[3:])
    assert isinstance(again.error, SessionFinished)
    assert await store.read_tokens(record.session_id) == committed
    verifier.close()


@pytest.mark.parametrize("kind", ["max_new_tokens", "stop_token", "stop_string"])
async def test_stop_inside_a_proposal_commits_nothing_after_it(target, store, kind):
    """One plain step, then a fully acceptable greedy proposal of 5 in which a stop falls on the 2nd token."""
    chain = greedy_continuation(target, PROMPT, 6)
    text = target.tokenizer.decode
    end = 3  # the stop falls on chain[end - 1]
    if kind == "max_new_tokens":
        stop, reason = StopConditions(max_new_tokens=3, ignore_eos=True), common_pb2.FINISH_REASON_LENGTH
    elif kind == "stop_token":
        assert chain[2] != chain[0]
        stop = StopConditions(stop_token_ids=(chain[2],), ignore_eos=True)
        reason = common_pb2.FINISH_REASON_STOP_TOKEN
        end = chain.index(chain[2], 1) + 1  # the first occurrence after the plain step ends it
    else:
        stop_string = text(chain[:3], skip_special_tokens=True)
        assert stop_string and stop_string not in text(chain[:2], skip_special_tokens=True)
        stop = StopConditions(stop_strings=(stop_string,), ignore_eos=True)
        reason = common_pb2.FINISH_REASON_STOP_STRING
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, GREEDY, stop)
    first = (await verify_one(verifier, record)).verdict
    assert first.committed_token_ids == (chain[0],) and first.finish_reason == 0
    verdict = (await verify_one(verifier, await store.load(record.session_id), chain[1:6])).verdict
    assert verdict.committed_token_ids == tuple(chain[1:end])
    assert verdict.finish_reason == reason
    assert verdict.accepted_count == end - 1 and not verdict.bonus
    committed = PROMPT + tuple(chain[:end])
    assert await store.read_tokens(record.session_id) == committed
    assert_cache_holds(verifier, record.session_id, committed)
    verifier.close()


@pytest.mark.parametrize("how", ["cold_start", "eviction"])
async def test_session_rebuilt_from_redis_continues_identically(target, draft, store, how):
    """A session a replica never saw (or evicted) is rebuilt from Redis alone and gives the verdicts and the
    logits of a twin session that stayed cached all along (sampled, fixed seeds, draft-model proposals)."""
    params = SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=99)
    steady = make_verifier(target, store)
    other = make_verifier(target, store, max_sessions=1)
    a = await new_session(store, PROMPT, params)  # served by `steady` throughout
    b = await new_session(
        store, PROMPT, params
    )  # `steady`, then `other` (cold start), or always `other` (evicted)
    c = await new_session(store, (9, 8, 7), params)  # shares `other` with b and evicts it
    gen = torch.Generator().manual_seed(3)
    for rnd in range(4):
        tokens, probs = draft_proposal(draft, a.token_ids, 3, params, gen)
        want = await verify_one(steady, a, tokens, probs)
        if how == "cold_start":
            server = steady if rnd < 2 else other
        else:
            server = other
            await verify_one(other, c, *draft_proposal(draft, c.token_ids, 2, params, gen))
            c = await store.load(c.session_id)
            assert b.session_id not in other.caches  # evicted by c
        got = await verify_one(server, b, tokens, probs)
        assert got.verdict == want.verdict, f"round {rnd}"
        a, b = await store.load(a.session_id), await store.load(b.session_id)
        assert a.token_ids == b.token_ids
    assert_cache_holds(other, b.session_id, b.token_ids)
    steady.close()
    other.close()


@pytest.mark.parametrize(("proposer", "penalty"), [("none", 1.0), ("draft", 1.3)])
async def test_greedy_chain_reproduces_target_generate(target, draft, store, proposer, penalty):
    """Verifying empty proposals (gamma = 0), or greedy draft proposals, round after round commits exactly
    the target's own ``generate(do_sample=False)`` output (float32)."""
    n_new = 14
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params, StopConditions(max_new_tokens=n_new))
    rounds = 0
    while not record.finished:
        tokens = greedy_continuation(draft, record.token_ids, 3, params) if proposer == "draft" else []
        result = await verify_one(verifier, record, tokens)
        assert result.error is None
        record = await store.load(record.session_id)
        rounds += 1
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        expected = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n_new,
            repetition_penalty=penalty,
            pad_token_id=0,
        )[0].tolist()
    assert list(record.token_ids) == expected
    if proposer == "none":
        assert rounds == len(expected) - len(PROMPT)
    assert_cache_holds(verifier, record.session_id, record.token_ids)
    verifier.close()


async def test_per_item_state_errors_leave_other_items_and_sessions_intact(target, store):
    """Unknown session -> NotFound, stale base (two commits behind; one behind is a retry) -> VersionConflict, finished -> SessionFinished, per item; the
    good item of the same batch commits, and the refused sessions' logs do not move."""
    verifier = make_verifier(target, store)
    good = await new_session(store, PROMPT)
    stale = await new_session(store, PROMPT)
    done = await new_session(store, PROMPT, GREEDY, StopConditions(max_new_tokens=1, ignore_eos=True))
    await verify_one(verifier, stale)
    await verify_one(verifier, await store.load(stale.session_id))  # stale is now two commits behind
    await verify_one(verifier, done)
    done = await store.load(done.session_id)
    ghost = item(good, (1, 2))
    ghost = type(ghost)(base=type(ghost.base)("no-such-session", 3, 0), proposal=ghost.proposal)
    batch = VerifyBatch(items=(item(stale, (1, 2)), ghost, item(good, (4,)), item(done, (5,))))
    results = (await verifier.verify(batch)).results
    assert isinstance(results[0].error, VersionConflict)
    assert isinstance(results[1].error, NotFound)
    assert results[2].verdict is not None and results[2].verdict.new_version == 1
    assert isinstance(results[3].error, SessionFinished)
    assert len(await store.read_tokens(stale.session_id)) == len(PROMPT) + 2
    assert len(await store.read_tokens(done.session_id)) == len(PROMPT) + 1
    assert_cache_holds(verifier, stale.session_id, await store.read_tokens(stale.session_id))
    # Retrying the good item replays its verdict without a second commit.
    again = (await verifier.verify(VerifyBatch(items=(item(good, (4,)),)))).results[0]
    assert again.replayed and again.verdict == results[2].verdict
    assert await store.read_tokens(good.session_id) == PROMPT + results[2].verdict.committed_token_ids
    verifier.close()


class RacingStore:
    """The real SessionStore (real Redis) with one twist, named here as a test double: before each ``commit``
    a rival writer commits ``rivals`` one-token verdicts to the same session first, so the race happens on cue."""

    def __init__(self, store, rivals: int):
        self._store = store
        self.rivals = rivals

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def commit(self, session_id, base_version, verdict):
        length = verdict.committed_len - len(verdict.committed_token_ids)
        for i in range(self.rivals):
            rival = Verdict(
                accepted_count=0,
                committed_token_ids=(1,),
                bonus=False,
                new_version=base_version + i + 1,
                committed_len=length + i + 1,
            )
            await self._store.commit(session_id, base_version + i, rival)
        return await self._store.commit(session_id, base_version, verdict)


@pytest.mark.parametrize("rivals", [1, 2])
async def test_lost_compare_and_set_rolls_the_branch_back(target, store, rivals):
    """Another writer commits between this replica's load and its compare-and-set. With one rival commit ours
    is, to the store, a retry of the same base: the rival's verdict comes back as a replay. With two, ours is
    stale: VersionConflict (ABORTED). Either way nothing of this round is committed and the cache is rolled
    back to the prefix the round started from."""
    verifier = make_verifier(target, RacingStore(store, rivals))
    record = await new_session(store, PROMPT)
    chain = greedy_continuation(target, PROMPT, 4)
    result = await verify_one(verifier, record, chain[:3])
    if rivals == 1:
        assert result.replayed and result.verdict.committed_token_ids == (1,)
    else:
        assert isinstance(result.error, VersionConflict)
    assert await store.read_tokens(record.session_id) == PROMPT + (1,) * rivals
    assert verifier.caches.get(record.session_id).tokens == PROMPT[:-1]  # branch rolled back
    # The next round on this replica reconciles with the log and decodes as target-only decoding would.
    current = await store.load(record.session_id)
    verifier.store = store
    nxt = await verify_one(verifier, current)
    assert nxt.verdict.committed_token_ids == tuple(greedy_continuation(target, current.token_ids, 1))
    assert_cache_holds(verifier, record.session_id, current.token_ids + nxt.verdict.committed_token_ids)
    verifier.close()


async def test_sampled_verdicts_equal_the_sampler_on_target_only_distributions(target, draft, store):
    """Over several rounds of draft proposals with every processor on (temperature, top-k, top-p, min-p,
    repetition penalty), each verdict equals ``verify_batch`` run by hand on target-only distributions from
    fresh prefills with the tentative prefix as penalty context: the verifier feeds the sampler the right p."""
    params = SamplingParams(
        temperature=0.9, top_k=60, top_p=0.9, min_p=0.01, repetition_penalty=1.3, seed=2024
    )
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)
    gen = torch.Generator().manual_seed(11)
    seen: set[int] = set()
    for _ in range(6):
        # q = half the draft's distribution, half the target's: any q is exact; this one gets accepted often.
        seq, tokens, rows, p_rows = list(record.token_ids), [], [], []
        for _ in range(3):
            p_i = next_probs(target, seq, params)
            q_i = 0.5 * next_probs(draft, seq, params) + 0.5 * p_i
            tokens.append(int(torch.multinomial(q_i, 1, generator=gen)))
            rows.append(q_i)
            p_rows.append(p_i)
            seq.append(tokens[-1])
        p_rows.append(next_probs(target, seq, params))
        p, probs = torch.stack(p_rows), torch.stack(rows)  # [4, vocab], [3, vocab]
        want = verify_batch(
            p[None], [DraftProposal(tuple(tokens), probs)], [params.seed], [record.committed_len]
        )[0]
        got = (await verify_one(verifier, record, tokens, probs)).verdict
        assert got.accepted_count == want.accepted and got.bonus == want.bonus
        assert got.committed_token_ids == want.emitted(tokens)
        seen.add(want.accepted)
        record = await store.load(record.session_id)
    assert len(seen) >= 2, f"accepted counts {seen}: the rounds should mix acceptance and rejection"
    assert_cache_holds(verifier, record.session_id, record.token_ids)
    verifier.close()


async def test_coupled_verdicts_are_target_only_gumbel_max_whatever_is_proposed(target, draft, store):
    """A coupled session (every processor on) verified in one batch with an optimal and a greedy session,
    over rounds whose proposals are the coupled draft's tokens (same noise), the draft's tokens under
    another seed's noise, arbitrary tokens with a q attached, nothing, or the target's own coupled
    tokens (a perfect draft: all accepted, then the bonus): every committed token is
    ``argmax(log p_j + G_j)`` of the target alone (fresh prefills, noise of (seed, j)), and the other
    sessions in the batch are unaffected by it."""
    params = SamplingParams(
        temperature=0.9,
        top_k=60,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.3,
        seed=77,
        sampling_mode="coupled",
    )
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)
    others = [
        await new_session(store, PROMPT, SamplingParams(temperature=0.9, seed=77)),
        await new_session(store, PROMPT, GREEDY),
    ]

    def gumbel_token(model, seq, seed):
        probs = next_probs(model, seq, params)  # [vocab] float64
        return int(torch.argmax(probs.log() + gumbel_noise([seed], [len(seq)], model.vocab_size)[0]))

    kinds = ["coupled", "other-noise", "arbitrary", "empty", "perfect", "coupled", "arbitrary"]
    for rnd, kind in enumerate(kinds):
        seq, tokens = list(record.token_ids), []
        for _ in range(3 if kind != "empty" else 0):
            if kind == "arbitrary":
                tokens.append((31 * len(seq) + rnd) % target.vocab_size)
            elif kind == "perfect":
                tokens.append(gumbel_token(target, seq, params.seed))
            else:
                tokens.append(gumbel_token(draft, seq, params.seed if kind == "coupled" else params.seed + 1))
            seq.append(tokens[-1])
        probs = torch.full((len(tokens), target.vocab_size), 1.0 / target.vocab_size, dtype=torch.float64)
        batch = VerifyBatch(
            items=(
                item(record, tokens, probs if kind == "arbitrary" else None),
                item(others[0]),
                item(others[1]),
            )
        )
        got, *rest = (await verifier.verify(batch)).results
        assert all(r.error is None for r in rest)
        expected, seq = [], list(record.token_ids)
        for _ in got.verdict.committed_token_ids:
            expected.append(gumbel_token(target, seq, params.seed))
            seq.append(expected[-1])
        assert list(got.verdict.committed_token_ids) == expected, (rnd, kind)
        assert got.verdict.committed_token_ids[: got.verdict.accepted_count] == tuple(
            tokens[: got.verdict.accepted_count]
        )
        if kind == "perfect":
            assert got.verdict.accepted_count == 3 and got.verdict.bonus
        record = await store.load(record.session_id)
        others = [await store.load(o.session_id) for o in others]
    assert_cache_holds(verifier, record.session_id, record.token_ids)
    verifier.close()


async def test_repetition_penalty_sees_the_tentative_prefix(target, store):
    """Greedy with a strong repetition penalty, at a prompt where penalising the proposed x1 changes the argmax
    of the next position: the target-only chain [x1, x2] (x1 penalised at position 2) is accepted whole, which
    holds only if position i is processed with the context C + x[:i]."""
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(80):  # find a prompt where the tentative prefix matters (precondition of the test)
        prompt = tuple(torch.randint(0, target.vocab_size, (6,), generator=gen).tolist())
        x1 = int(next_probs(target, prompt, params).argmax())
        logits = fresh_logits(target, (*prompt, x1))[-1:]
        right = int(logits_to_probs(logits, params, [(*prompt, x1)])[0].argmax())
        if right != int(logits_to_probs(logits, params, [prompt])[0].argmax()):
            break
    else:
        pytest.fail("no prompt where the penalty context changes the argmax")
    verifier = make_verifier(target, store)
    record = await new_session(store, prompt, params)
    verdict = (await verify_one(verifier, record, (x1, right))).verdict
    assert verdict.accepted_count == 2 and verdict.bonus
    assert verdict.committed_token_ids == (
        x1,
        right,
        *greedy_continuation(target, (*prompt, x1, right), 1, params),
    )
    verifier.close()


async def test_concurrent_and_cancelled_calls_commit_once(target, store):
    """Two concurrent Verify calls for the same (session, version) commit once: the second replays the first's
    verdict. A call cancelled by its caller after it started still finishes its round (caches never see half a
    round), and the caller's retry gets that verdict back as a replay."""
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT)
    chain = greedy_continuation(target, PROMPT, 3)
    batch = VerifyBatch(items=(item(record, chain[:2]),))
    first, second = await asyncio.gather(verifier.verify(batch), verifier.verify(batch))
    assert [first.results[0].replayed, second.results[0].replayed] == [False, True]
    assert first.results[0].verdict == second.results[0].verdict
    assert await store.read_tokens(record.session_id) == PROMPT + tuple(chain)

    record = await store.load(record.session_id)
    batch = VerifyBatch(items=(item(record),))
    call = asyncio.ensure_future(verifier.verify(batch))
    await asyncio.sleep(0)  # the call starts its round ...
    call.cancel()  # ... and its caller goes away
    with pytest.raises(asyncio.CancelledError):
        await call
    retry = (await verifier.verify(batch)).results[0]
    assert retry.replayed and retry.verdict.new_version == record.version + 1
    committed = await store.read_tokens(record.session_id)
    assert committed == record.token_ids + retry.verdict.committed_token_ids
    assert_cache_holds(verifier, record.session_id, committed)
    verifier.close()


# --------------------------------------------------------------------------- each item has its own fate



@pytest.mark.parametrize("bad_sampling", [GREEDY, SamplingParams(temperature=0.9, seed=3)], ids=["greedy", "sampled"])
async def test_a_row_without_a_distribution_fails_alone_and_its_batch_mates_are_verified_as_if_absent(
    poisoned_target, store, bad_sampling
):
    """One session reaches the NaN position (greedy: its argmax would silently pick the NaN): it gets
    InvalidDistribution for itself, nothing is committed for it and its cache is rolled back; the 8 other
    sessions of the same padded pass get exactly the verdicts their twins get verified without it."""
    target = poisoned_target
    together, alone = make_verifier(target, store), make_verifier(target, store)
    gen = torch.Generator().manual_seed(11)
    items_batch, items_solo = [], []
    for i in range(8):
        prompt = PROMPTS[i % len(PROMPTS)] + (i + 1,)
        params = GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, seed=200 + i)
        rec_b, rec_s = await new_session(store, prompt, params), await new_session(store, prompt, params)
        if params.greedy:
            tokens, probs = greedy_proposal(target, prompt, 3, None), None
        else:
            tokens, probs = draft_proposal(target, prompt, 3, params, gen)
        items_batch.append(item(rec_b, tokens, probs))
        items_solo.append(item(rec_s, tokens, probs))
    bad = await new_session(store, tuple(range(1, NAN_AT + 6)), bad_sampling)
    items_batch.insert(4, item(bad, (3, 4)))
    result = await together.verify(VerifyBatch(items=tuple(items_batch)))
    refused = result.results[4]
    assert refused.session_id == bad.session_id and refused.verdict is None
    assert type(refused.error).__name__ == "InvalidDistribution" and "NaN" in refused.error.message
    assert await store.read_tokens(bad.session_id) == bad.token_ids
    assert together.caches.get(bad.session_id).tokens == bad.token_ids[:-1]
    verified = [r for i, r in enumerate(result.results) if i != 4]
    for got, solo_item in zip(verified, items_solo, strict=True):
        solo = (await alone.verify(VerifyBatch(items=(solo_item,)))).results[0]
        assert got.error is None and got.verdict == solo.verdict
    together.close()
    alone.close()


async def test_a_proposal_the_acceptance_rule_refuses_fails_alone(target, store):
    """A proposal whose q is not a distribution (an in-process caller's bug; the wire form is checked before)
    makes verify_batch refuse the batch: each row is then verified alone, so only that row fails."""
    verifier = make_verifier(target, store)
    params = SamplingParams(temperature=1.0, seed=9)
    good = await new_session(store, PROMPT, params)
    twin = await new_session(store, PROMPT, params)
    broken = await new_session(store, PROMPT, params)
    p = next_probs(target, PROMPT, params)  # [vocab] float64
    q = sure_accept_q(p, 5).unsqueeze(0)  # [1, vocab]
    bad_q = q.clone()
    bad_q[0, 7] = -0.5  # negative mass
    result = await verifier.verify(VerifyBatch(items=(item(good, (5,), q), item(broken, (5,), bad_q))))
    assert result.results[0].error is None and result.results[0].verdict.accepted_count == 1
    assert type(result.results[1].error).__name__ == "InvalidDistribution"
    solo = (await verifier.verify(VerifyBatch(items=(item(twin, (5,), q),)))).results[0]
    assert result.results[0].verdict == solo.verdict
    verifier.close()


@pytest.mark.parametrize(
    ("prompt_len", "gamma", "committed", "finish"),
    [
        (509, 3, 3, common_pb2.FINISH_REASON_LENGTH),  # all accepted: the bonus would sit at index 512
        (508, 3, 4, common_pb2.FINISH_REASON_LENGTH),  # accepted + bonus fill the context exactly
        (507, 3, 4, common_pb2.FINISH_REASON_UNSPECIFIED),  # one position left: the session goes on
    ],
)
async def test_the_log_never_passes_the_context_and_a_full_log_finishes_with_length(
    target, store, prompt_len, gamma, committed, finish
):
    """Context 512 (max_position_embeddings): a round is cut where the log reaches 512 tokens and then
    finishes with `length`; nothing is ever committed at index 512 (the target could never feed it)."""
    verifier = make_verifier(target, store)
    prompt = tuple((7 * i + 3) % 380 + 1 for i in range(prompt_len))
    record = await new_session(store, prompt)
    chain = greedy_continuation(target, prompt, gamma + 1)
    result = await verify_one(verifier, record, chain[:gamma])
    verdict = result.verdict
    assert verdict.committed_token_ids == tuple(chain[:committed])
    assert (verdict.committed_len, verdict.finish_reason) == (prompt_len + committed, finish)
    assert verdict.committed_len <= 512
    nxt = await verify_one(verifier, await store.load(record.session_id))
    if finish == common_pb2.FINISH_REASON_LENGTH:
        assert type(nxt.error).__name__ == "SessionFinished"
    else:  # the last position: one more token, then `length`
        assert nxt.verdict.committed_len == 512 and nxt.verdict.finish_reason == common_pb2.FINISH_REASON_LENGTH
    verifier.close()


async def test_a_proposal_that_does_not_fit_the_context_is_refused_for_itself(target, store):
    verifier = make_verifier(target, store)
    record = await new_session(store, tuple((7 * i + 3) % 380 + 1 for i in range(509)))
    result = await verify_one(verifier, record, (1, 2, 3, 4))
    assert type(result.error).__name__ == "InvalidArgument" and "propose at most 3" in result.error.message
    assert await store.read_tokens(record.session_id) == record.token_ids


LOGPROB_SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+penalty": SamplingParams(temperature=0.0, repetition_penalty=1.4),
    "sampled": SamplingParams(temperature=0.8, top_k=12, top_p=0.95, repetition_penalty=1.2, seed=5),
    "coupled": SamplingParams(temperature=1.2, top_p=0.9, seed=6, sampling_mode="coupled"),
}


@pytest.mark.parametrize("name", list(LOGPROB_SETTINGS), ids=list(LOGPROB_SETTINGS))
async def test_logprobs_are_the_targets_processed_distribution_and_survive_replay_and_failover(
    target, store, name
):
    """Each committed token carries log p at its position (Hugging Face's processors on a fresh prefill, to 1e-4)
    and the most likely alternatives; a retried Verify, on this replica or on a fresh one (failover), returns the
    recorded values bit for bit; an item that does not ask gets none."""
    params = LOGPROB_SETTINGS[name]
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)
    chain = greedy_continuation(target, PROMPT, GAMMA, params)
    proposal = [*chain[:3], wrong(chain[3], target.vocab_size)]  # greedy: three accepted, then a correction
    batch = VerifyBatch(items=(item(record, proposal, top_logprobs=5),))
    result = (await verifier.verify(batch)).results[0]
    verdict = result.verdict
    assert verdict is not None and len(verdict.logprobs) == len(verdict.committed_token_ids) >= 1
    if params.greedy:
        assert verdict.accepted_count == 3, "accepted draft tokens carry logprobs, not only the correction"
    context = list(PROMPT)
    for token, entry in zip(verdict.committed_token_ids, verdict.logprobs, strict=True):
        want = hf_logprobs(target, context, params)  # [vocab]
        assert entry.token_id == token and math.isfinite(entry.logprob)
        assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
        top = torch.topk(want, 5)
        expected = [(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True) if v > -math.inf]
        assert [t.token_id for t in entry.top_logprobs] == [t for t, _ in expected]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in expected], abs=1e-4)
        if params.top_k:
            assert len(entry.top_logprobs) == 5 <= params.top_k
        context.append(token)
    replay = (await verifier.verify(batch)).results[0]
    assert replay.replayed and replay.verdict == verdict
    other = make_verifier(target, store)  # another replica: no cache, the record from Redis alone
    assert (await other.verify(batch)).results[0].verdict == verdict
    record = await store.load(record.session_id)
    plain = (await verifier.verify(VerifyBatch(items=(item(record, chain[:2]),)))).results[0].verdict
    assert plain is not None and plain.logprobs == ()
    verifier.close()
    other.close()


async def test_a_top_k_smaller_than_top_logprobs_lists_only_the_kept_tokens(target, store):
    params = SamplingParams(temperature=1.0, top_k=3, seed=9)
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT, params)
    verdict = (await verifier.verify(VerifyBatch(items=(item(record, top_logprobs=20),)))).results[0].verdict
    (entry,) = verdict.logprobs
    assert len(entry.top_logprobs) == 3 and entry.token_id in {t.token_id for t in entry.top_logprobs}
    assert sum(math.exp(t.logprob) for t in entry.top_logprobs) == pytest.approx(1.0, abs=1e-9)
    verifier.close()


# --------------------------------------------------------------------------- a round that reads nothing


class CountingStore:
    """The real store, counting ``load`` calls (the one per-round Redis read a known session skips)."""

    def __init__(self, store) -> None:
        self._store = store
        self.loads = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def load(self, session_id, **kwargs):
        self.loads += 1
        return await self._store.load(session_id, **kwargs)


async def test_a_round_after_this_replicas_own_commit_reads_nothing_from_redis(target, store):
    """After a commit the replica knows the log exactly; the next round based on it loads nothing, and the
    chain still equals target-only greedy decoding and the log (the compare-and-set still checks each)."""
    counting = CountingStore(store)
    verifier = make_verifier(target, counting)
    record = await new_session(store, PROMPT)
    chain = greedy_continuation(target, PROMPT, 12)
    committed: list[int] = []
    for _ in range(4):
        current = record if not committed else await store.load(record.session_id)
        result = await verify_one(verifier, current, chain[len(committed) : len(committed) + 2])
        committed += result.verdict.committed_token_ids
    assert counting.loads == 1, "only the first round loads the session"
    assert tuple(committed) == tuple(chain[: len(committed)])
    assert await store.read_tokens(record.session_id) == PROMPT + tuple(committed)
    assert_cache_holds(verifier, record.session_id, PROMPT + tuple(committed))
    verifier.close()


async def test_a_stale_hint_is_caught_by_the_compare_and_set_and_dropped(target, store):
    """Replica A commits v0 -> v1; replica B, given the same base by a coordinator that lost A's reply, gets
    A's verdict back (a replay); then B commits v1 -> v2. A stale coordinator sends A an item based on v1:
    A's hint matches, so it computes without a load, but the compare-and-set finds v2 and refuses it; A rolls
    its cache back, drops the hint, and the next item (based on v2) is loaded and verified from the log."""
    a = make_verifier(target, store)
    b = make_verifier(target, store)
    record = await new_session(store, PROMPT)
    first = await verify_one(a, record)  # v0 -> v1 on A
    replay = await verify_one(b, record)  # the same base on B: the recorded verdict
    assert replay.replayed and replay.verdict == first.verdict
    v1 = await store.load(record.session_id)
    second = await verify_one(b, v1)  # v1 -> v2 on B
    assert second.verdict.new_version == 2
    stale = await verify_one(a, v1)  # A still believes v1 is current
    assert stale.replayed and stale.verdict == second.verdict, "the CAS answers with the recorded verdict"
    assert a.caches.get(record.session_id).tokens == v1.token_ids[:-1], "A's branch rolled back"
    v2 = await store.load(record.session_id)
    third = await verify_one(a, v2)
    assert third.verdict.committed_token_ids == tuple(greedy_continuation(target, v2.token_ids, 1))
    assert await store.read_tokens(record.session_id) == v2.token_ids + third.verdict.committed_token_ids
    a.close()
    b.close()
