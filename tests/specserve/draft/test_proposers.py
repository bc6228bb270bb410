"""specserve.draft.proposers: the draft distribution, prompt lookup, the model proposer's cache, and batches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specserve.api.errors import InvalidArgument
from specserve.api.params import SamplingParams
from specserve.core.proposal import draft_probs_from_pb, draft_probs_to_pb
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.core.rng import Purpose, gumbel_noise, uniform
from specserve.core.sampling import check_distribution, logits_to_probs, processed_logprobs, sample_from
from specserve.core.tree import DraftTree
from specserve.draft.messages import ProposeResult
from specserve.draft.proposers import (
    Drafted,
    DraftRequest,
    ModelProposer,
    draft_distribution,
    rank_alternatives,
)
from specserve.draft.servicer import proposal_pb
from specserve.engine import cpu_kernels, row_invariant
from specserve.engine.kvcache import SessionCacheStore

pytestmark = pytest.mark.unit

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11, 64, 120)


@torch.inference_mode()
def fresh_logits(model, tokens) -> torch.Tensor:
    return model(input_ids=torch.tensor([list(tokens)])).logits[0, -1].float()  # [vocab]


def test_draft_distribution_without_truncation_is_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # [1, 5]
    params = SamplingParams(temperature=0.7, top_p=0.9)
    q = draft_distribution(logits, params, [[1, 2]], 0)
    assert q.dtype == torch.float32
    torch.testing.assert_close(q, logits_to_probs(logits, params, [[1, 2]]).float(), atol=0, rtol=0)


def test_draft_top_k_keeps_the_k_most_likely_and_renormalises():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, -1.0]])  # [1, 6], a tie between ids 1 and 3
    q = draft_distribution(logits, SamplingParams(temperature=1.0), [[]], 2)[0]  # [6]
    assert torch.nonzero(q).reshape(-1).tolist() == [1, 3]
    assert q[1] == q[3] and abs(float(q.sum()) - 1.0) < 1e-6
    q3 = draft_distribution(logits, SamplingParams(temperature=1.0), [[]], 3)[0]
    full = torch.softmax(logits[0].double(), -1)
    expected = torch.zeros(6, dtype=torch.float64)
    expected[[1, 3, 4]] = full[[1, 3, 4]] / full[[1, 3, 4]].sum()
    torch.testing.assert_close(q3, expected.float(), atol=1e-7, rtol=0)


def test_greedy_distribution_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 0.9, 0.3]])
    q = draft_distribution(logits, SamplingParams(temperature=0.0), [[]], 0)
    assert q.tolist() == [[0.0, 1.0, 0.0]]


def test_model_proposer_samples_from_the_vectors_it_ships(draft_model):
    model = draft_model.model
    store = SessionCacheStore(model, max_sessions=4, budget_bytes=10**9, ttl_s=60)
    proposer = ModelProposer(store)
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=7)
    request = DraftRequest("s", PROMPT, gamma=5, sampling=params, seed=7)
    drafted = proposer.propose(request)
    assert len(drafted.token_ids) == 5 and drafted.probs_f32.shape == (5, draft_model.vocab_size)
    assert drafted.prefill_tokens == len(PROMPT)
    seq = list(PROMPT)
    for i, token in enumerate(drafted.token_ids):
        expected = logits_to_probs(fresh_logits(model, seq).unsqueeze(0), params, [seq]).float()[0]
        torch.testing.assert_close(drafted.probs_f32[i], expected, atol=1e-5, rtol=0)
        q = check_distribution(drafted.probs_f32[i])
        assert token == sample_from(q, uniform(7, len(PROMPT) + i, Purpose.DRAFT))
        seq.append(token)
    # The cache holds C + x1..x_{gamma-1} (the branch) ...
    cache = store.get("s")
    assert cache.tokens == PROMPT + drafted.token_ids[:-1]
    assert cache.committed_len == len(PROMPT)
    # ... and the same request again (a retry) drafts the same tokens with one re-fed token.
    again = proposer.propose(request)
    assert again.token_ids == drafted.token_ids and again.prefill_tokens == 1
    torch.testing.assert_close(again.probs_f32, drafted.probs_f32, atol=1e-5, rtol=0)
    assert proposer.release("s") and not proposer.release("s")


@pytest.mark.parametrize("draft_top_k", [0, 5])
def test_model_proposer_in_coupled_mode_takes_the_gumbel_argmax_and_ships_tokens_only(
    draft_model, draft_top_k
):
    """x_i = argmax(log q_i + G_i) with G_i the Gumbel noise of (seed, position), written out here from
    the model's own logits; no distributions travel (the reply carries token ids only)."""
    model = draft_model.model
    store = SessionCacheStore(model, max_sessions=4, budget_bytes=10**9, ttl_s=60)
    params = SamplingParams(temperature=0.8, repetition_penalty=1.1, seed=31, sampling_mode="coupled")
    drafted = ModelProposer(store).propose(
        DraftRequest("c", PROMPT, gamma=4, sampling=params, seed=31, draft_top_k=draft_top_k)
    )
    assert drafted.probs_f32 is None and len(drafted.token_ids) == 4
    seq = list(PROMPT)
    for i, token in enumerate(drafted.token_ids):
        q = draft_distribution(fresh_logits(model, seq).unsqueeze(0), params, [seq], draft_top_k)[0].double()
        noise = gumbel_noise([31], [len(PROMPT) + i], draft_model.vocab_size)[0]
        assert token == int(torch.argmax(q.log() + noise))
        seq.append(token)
    reply = proposal_pb(ProposeResult(drafted, draft_ns=1))
    assert list(reply.proposal.token_ids) == list(drafted.token_ids) and not reply.proposal.distributions


def test_model_proposer_stops_at_the_context_limit(draft_model):
    store = SessionCacheStore(draft_model.model, max_sessions=4, budget_bytes=10**9, ttl_s=60)
    limit = store.get_or_create("probe")[0].max_positions
    assert limit == 512  # the tiny models' max_position_embeddings
    committed = tuple((7 * i) % 300 + 1 for i in range(limit - 2))
    drafted = ModelProposer(store).propose(
        DraftRequest("long", committed, gamma=5, sampling=SamplingParams(temperature=0.0), seed=0)
    )
    assert len(drafted.token_ids) == 2  # C + x1 + x2 fills the context exactly


def _wire(drafted) -> list[bytes] | None:
    """What the draft ships for ``q``, as bytes (None: greedy, point masses)."""
    if drafted.probs_f32 is None:
        return None
    return [d.SerializeToString() for d in draft_probs_to_pb(drafted.probs_f32, drafted.sparse)]


def _eight_sessions(vocab_size: int) -> list[DraftRequest]:
    """Mixed prompt lengths (two above the inline catch-up limit), mixed gamma, greedy and seeded sampling."""
    gen = torch.Generator().manual_seed(17)
    lengths = (3, 40, 7, 120, 1, 15, 64, 9)
    gammas = (4, 1, 8, 3, 5, 2, 6, 4)
    requests = []
    for i, (n, gamma) in enumerate(zip(lengths, gammas, strict=True)):
        committed = tuple(torch.randint(1, vocab_size, (n,), generator=gen).tolist())
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(
                temperature=0.9, top_p=0.95, repetition_penalty=1.1 if i == 5 else 1.0, seed=100 + i
            )
        requests.append(
            DraftRequest(
                f"s{i}",
                committed,
                gamma=gamma,
                sampling=params,
                seed=params.seed,
                draft_top_k=5 if i == 3 else 0,
            )
        )
    return requests


def _store(model) -> SessionCacheStore:
    return SessionCacheStore(model, max_sessions=64, budget_bytes=10**9, ttl_s=600)


@pytest.mark.parametrize(
    "kernels",
    [
        "stock",
        pytest.param(
            "onednn", marks=pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="no oneDNN ops here")
        ),
    ],
)
def test_eight_sessions_drafted_in_one_batch_equal_each_drafted_alone(draft_model, kernels):
    """Token for token, with the same q bytes, in two rounds (the second after partial acceptance); with
    the stock kernels in 16-row blocks and with packed weights, rows unpadded (the draft service's default)."""
    alone = ModelProposer(_store(draft_model.model), kernels=kernels)
    batched = ModelProposer(_store(draft_model.model), kernels=kernels)
    requests = _eight_sessions(draft_model.vocab_size)
    for round_ in range(2):
        by_alone = [alone.propose(r) for r in requests]
        by_batch = batched.propose_batch(requests)
        for r, a, b in zip(requests, by_alone, by_batch, strict=True):
            assert isinstance(b, Drafted)
            assert b.token_ids == a.token_ids, f"round {round_}, {r.session_id}"
            assert _wire(b) == _wire(a), f"round {round_}, {r.session_id}: q bytes differ"
            assert b.prefill_tokens == a.prefill_tokens
            assert len(a.token_ids) == r.gamma
            assert (a.probs_f32 is None) == r.sampling.greedy
            assert batched.caches.get(r.session_id).tokens == alone.caches.get(r.session_id).tokens
        # The next round: the first proposed token and a correction committed.
        requests = [
            DraftRequest(
                r.session_id, (*r.committed, *a.token_ids[:1], 7), r.gamma, r.sampling, r.seed, r.draft_top_k
            )
            for r, a in zip(requests, by_alone, strict=True)
        ]
    # Only what the caches lack is fed: the correction (gamma 4 cached x1), or x1 and the correction (gamma 1
    # caches no branch).
    assert [d.prefill_tokens for d in batched.propose_batch(requests[:2])] == [1, 2]


def test_a_batched_proposal_matches_the_draft_model_run_fresh(draft_model):
    """Not only alone == batched: each session's greedy tokens are what its own prefill gives (no cache)."""
    requests = [
        DraftRequest(f"g{i}", PROMPT[: 3 + i], gamma=3, sampling=SamplingParams(temperature=0.0), seed=0)
        for i in range(4)
    ]
    drafted = ModelProposer(_store(draft_model.model)).propose_batch(requests)
    for r, d in zip(requests, drafted, strict=True):
        seq = list(r.committed)
        for token in d.token_ids:
            assert token == int(fresh_logits(draft_model.model, seq).argmax())
            seq.append(token)


def test_a_session_that_drafts_a_stop_token_drops_out_and_the_others_go_on(draft_model):
    greedy = SamplingParams(temperature=0.0)
    free = ModelProposer(_store(draft_model.model)).propose_batch(
        [DraftRequest(f"f{i}", PROMPT[i:], gamma=5, sampling=greedy, seed=0) for i in range(3)]
    )
    stop_at = free[1].token_ids[1]  # session 1 stops after its second token
    requests = [
        DraftRequest(
            f"f{i}",
            PROMPT[i:],
            gamma=5,
            sampling=greedy,
            seed=0,
            stop_token_ids=frozenset({stop_at}) if i == 1 else frozenset(),
        )
        for i in range(3)
    ]
    proposer = ModelProposer(_store(draft_model.model))
    stopped = proposer.propose_batch(requests)
    cut = free[1].token_ids.index(stop_at) + 1
    assert stopped[1].token_ids == free[1].token_ids[:cut] and cut <= 2
    assert stopped[0].token_ids == free[0].token_ids and stopped[2].token_ids == free[2].token_ids
    assert proposer.caches.get("f1").tokens == PROMPT[1:] + stopped[1].token_ids[:-1]


def test_a_batch_that_fails_drops_its_sessions_caches(draft_model, monkeypatch):
    proposer = ModelProposer(_store(draft_model.model))
    greedy = SamplingParams(temperature=0.0)
    requests = [DraftRequest(f"x{i}", PROMPT, gamma=3, sampling=greedy, seed=0) for i in range(2)]
    proposer.propose_batch(requests)
    assert "x0" in proposer.caches and "x1" in proposer.caches
    calls = []

    def failing(model, packed):
        calls.append(packed.batch_size)
        raise RuntimeError("injected: the device ran out of memory")

    monkeypatch.setattr(row_invariant, "forward", failing)
    with pytest.raises(RuntimeError, match="injected"):
        proposer.propose_batch(requests)
    assert calls == [2]
    assert "x0" not in proposer.caches and "x1" not in proposer.caches  # rebuilt from C next time


def test_requests_a_batch_cannot_serve_get_their_own_errors(draft_model):
    proposer = ModelProposer(_store(draft_model.model))
    greedy = SamplingParams(temperature=0.0)
    too_long = tuple(range(1, 515))  # the tiny models take 512 positions
    out = proposer.propose_batch(
        [
            DraftRequest("ok", PROMPT, gamma=2, sampling=greedy, seed=0),
            DraftRequest("long", too_long, gamma=2, sampling=greedy, seed=0),
            DraftRequest("zero", PROMPT, gamma=0, sampling=greedy, seed=0),
        ]
    )
    assert len(out[0].token_ids) == 2
    assert isinstance(out[1], InvalidArgument) and "512 positions" in out[1].message
    assert out[2].token_ids == () and "zero" not in proposer.caches  # nothing to draft: the model is not run


def _confidences(model, request: DraftRequest, drafted: Drafted) -> list[float]:
    """Each drafted token's probability under the distribution it was drawn from, recomputed from a fresh
    prefill: the shipped vector where there is one, else the processed distribution of fresh logits."""
    seq, out = list(request.committed), []
    for i, token in enumerate(drafted.token_ids):
        if drafted.probs_f32 is not None:
            q = check_distribution(drafted.probs_f32[i])
        elif request.sampling.greedy:  # a one-hot says nothing: the processed softmax at temperature 1
            q = processed_logprobs(fresh_logits(model, seq).unsqueeze(0), request.sampling, [seq])[0].exp()
        else:
            logits = fresh_logits(model, seq).unsqueeze(0)
            q = draft_distribution(logits, request.sampling, [seq], request.draft_top_k)[0].double()
        out.append(float(q[token]))
        seq.append(token)
    return out


def _with_confidence(request: DraftRequest, min_confidence: float) -> DraftRequest:
    return dataclasses.replace(request, min_confidence=min_confidence)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_p=0.95, seed=3),
        SamplingParams(temperature=0.9, seed=3, sampling_mode="coupled"),
    ],
    ids=["greedy", "greedy-penalty", "sampled", "coupled"],
)
def test_a_confidence_cut_proposal_is_the_whole_ones_prefix_up_to_the_first_unsure_token(draft_model, sampling):
    """Dynamic draft length: with ``min_confidence`` the proposal ends after the first token whose probability
    (recomputed here from a fresh prefill) is below it, that token included; the tokens and the q bytes
    shipped are the whole proposal's up to there, and the cache holds C and the tokens before the last."""
    model = draft_model.model
    whole_request = DraftRequest("c", PROMPT, gamma=8, sampling=sampling, seed=3)
    whole = ModelProposer(_store(model)).propose(whole_request)
    assert len(whole.token_ids) == 8
    conf = _confidences(model, whole_request, whole)
    # A threshold that cuts inside the proposal: between the confidences of the draft's own tokens.
    threshold = sorted(conf)[len(conf) // 2]
    cut = next(i for i, c in enumerate(conf) if c < threshold) + 1
    assert cut < 8, conf
    proposer = ModelProposer(_store(model))
    request = _with_confidence(whole_request, threshold)
    got = proposer.propose(request)
    assert got.token_ids == whole.token_ids[:cut], (conf, threshold)
    if whole.probs_f32 is not None:
        assert _wire(got) == [d.SerializeToString() for d in draft_probs_to_pb(whole.probs_f32[:cut], False)]
    else:
        assert got.probs_f32 is None
    assert proposer.caches.get("c").tokens == PROMPT + got.token_ids[:-1]
    # Below every confidence nothing is cut; 0 is the whole gamma.
    assert ModelProposer(_store(model)).propose(_with_confidence(whole_request, min(conf) / 2)).token_ids == (
        whole.token_ids
    )


def test_confidence_cut_sessions_in_one_batch_equal_each_drafted_alone(draft_model):
    """Mixed thresholds (none, low, high) over the eight mixed sessions: alone == batched, token for token and
    byte for byte, in two rounds; the high threshold cuts every session to its first token."""
    alone = ModelProposer(_store(draft_model.model))
    batched = ModelProposer(_store(draft_model.model))
    requests = [
        _with_confidence(r, (0.0, 0.5 / draft_model.vocab_size, 0.99)[i % 3])
        for i, r in enumerate(_eight_sessions(draft_model.vocab_size))
    ]
    for round_ in range(2):
        by_alone = [alone.propose(r) for r in requests]
        by_batch = batched.propose_batch(requests)
        for r, a, b in zip(requests, by_alone, by_batch, strict=True):
            assert b.token_ids == a.token_ids and _wire(b) == _wire(a), f"round {round_}, {r.session_id}"
            assert batched.caches.get(r.session_id).tokens == alone.caches.get(r.session_id).tokens
            if r.min_confidence == 0.99:  # a tiny random draft is never that sure
                assert len(a.token_ids) == 1
        requests = [
            dataclasses.replace(r, committed=(*r.committed, *a.token_ids[:1], 7))
            for r, a in zip(requests, by_alone, strict=True)
        ]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)])
def test_stop_tokens_are_masked_before_stop_tokens_from_and_drafted_after(draft_model, sampling):
    """min_new_tokens in the draft: a stop token the draft would take at a position before
    ``stop_tokens_from`` is masked out of its distribution (it drafts on, and ships vectors with no mass
    there); from that position on it is drafted as before."""
    free = ModelProposer(_store(draft_model.model)).propose(
        DraftRequest("m", PROMPT, gamma=4, sampling=sampling, seed=3)
    )
    first = free.token_ids[0]
    stops = frozenset({first})
    masked = ModelProposer(_store(draft_model.model)).propose(
        DraftRequest(
            "m", PROMPT, gamma=4, sampling=sampling, seed=3, stop_token_ids=stops,
            stop_tokens_from=len(PROMPT) + 4,
        )
    )
    assert first not in masked.token_ids and len(masked.token_ids) == 4
    if masked.probs_f32 is not None:
        assert float(masked.probs_f32[:, first].abs().max()) == 0.0
    later = ModelProposer(_store(draft_model.model)).propose(
        DraftRequest(
            "m", PROMPT, gamma=4, sampling=sampling, seed=3, stop_token_ids=stops, stop_tokens_from=len(PROMPT)
        )
    )
    assert later.token_ids == (first,)  # not masked at its position: drafted, and drafting ends there


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_constrained_draft_proposes_inside_the_grammar_and_ships_q_without_mass_outside(draft_model, temperature):
    """With the session's grammar the draft masks q: every drafted token keeps the completion in the grammar,
    each shipped vector has no mass on a token the grammar forbids there, and the matcher is back at C."""
    from specserve.api.constraints import Constraint
    from specserve.engine.grammar import SessionGrammars, unpack

    constraint = Constraint("regex", r"(def|class) [a-z]{2,8}\((a|b|self)?\):")
    grammars = SessionGrammars(draft_model.tokenizer, draft_model.vocab_size, [0], max_sessions=4)
    proposer = ModelProposer(_store(draft_model.model), grammars=grammars)
    prefix = tuple(draft_model.tokenizer.encode("def "))
    committed = PROMPT + prefix
    sampling = SamplingParams(temperature=temperature, seed=4, constraint=constraint)
    grammar = grammars.engine.compile(constraint)  # what the engine's prepare hands the proposer
    request = DraftRequest("g", committed, gamma=6, sampling=sampling, seed=4, prompt_len=len(PROMPT), grammar=grammar)
    drafted = proposer.propose(request)
    assert len(drafted.token_ids) >= 1
    assert grammars.held("g") == prefix  # the branch is rolled back: the matcher holds C's generated tokens
    check = grammars.engine.matcher(constraint)
    check.sync(prefix)
    for i, token in enumerate(drafted.token_ids):
        bitmask = check.allocate(1)
        check.fill_mask(bitmask, 0)
        allowed = unpack(bitmask, draft_model.vocab_size)[0]
        if drafted.probs_f32 is not None:
            assert float(drafted.probs_f32[i][~allowed].abs().max()) == 0.0
        assert check.accept(token), i
    unmasked = ModelProposer(_store(draft_model.model)).propose(request)  # no grammar: the tokens of the free draft
    free = grammars.engine.matcher(constraint)
    free.sync(prefix)
    assert not all(free.accept(t) for t in unmasked.token_ids)  # the tiny draft leaves the grammar unmasked


# ---- draft trees from the draft's own ranking --------------------------------------------------


def _ranked(model, request: DraftRequest, seq: list[int]) -> torch.Tensor:
    """The distribution a drafted token's alternatives are ranked by, from a fresh prefill: the one it was drawn
    from, or a greedy row's processed softmax at temperature 1."""
    logits = fresh_logits(model, seq).unsqueeze(0)
    if request.sampling.greedy:
        return processed_logprobs(logits, request.sampling, [seq])[0].exp()
    return draft_distribution(logits, request.sampling, [seq], request.draft_top_k)[0].double()


def _listed(ranked: torch.Tensor, token: int, noise: torch.Tensor | None, k: int) -> list[tuple[int, float]]:
    """A depth's candidates, recomputed: the ``k`` likeliest tokens other than ``token``; in the coupled mode
    (``noise``) the ``k`` next of ``log q + G`` instead, each with the probability of the likeliest of its rank."""
    order = torch.argsort(ranked, descending=True, stable=True).tolist()
    plain = [(t, float(ranked[t])) for t in order if t != token and ranked[t] > 0][:k]
    if noise is None:
        return plain
    scores = ranked.double().log() + noise.double()
    by_noise = [t for t in torch.argsort(scores, descending=True, stable=True).tolist() if t != token and ranked[t] > 0]
    return [(t, p) for t, (_, p) in zip(by_noise, plain, strict=False)]


def test_the_coupled_list_is_the_noises_ranking_with_the_plain_rankings_probabilities():
    """Alternatives in the coupled mode: the tokens after ``token`` by ``log q + G``, carrying the plain
    ranking's probabilities rank by rank; never a token of probability 0; without noise, the plain ranking."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    assert rank_alternatives(q, 0, 3) == ((1, pytest.approx(0.3)), (2, pytest.approx(0.15)), (3, pytest.approx(0.05)))
    # log q + G: token 3 then 2 then 1 after the chain's token 0; token 4 (q = 0) is never listed.
    noise = torch.tensor([5.0, 0.0, 1.5, 4.0, 99.0])
    got = rank_alternatives(q, 0, 3, noise)
    assert [t for t, _ in got] == [3, 2, 1]
    assert [p for _, p in got] == pytest.approx([0.3, 0.15, 0.05])
    assert [t for t, _ in rank_alternatives(q, 0, 2, noise)] == [3, 2]


def test_the_coupled_list_holds_the_targets_token_more_often_than_the_plain_ranking():
    """Why the coupled mode lists by its noise: over 2,000 (p, q) pairs with p a perturbation of q and the
    target's token ``argmax(log p + G)``, a list of the chain's token and one alternative holds the target's
    token more often when the alternative is the noise's next than when it is q's next (paired, same noise);
    the plain list does no better than chance of the two (a sign test at 2,000 pairs)."""
    g = torch.Generator().manual_seed(0)
    wins = losses = 0
    for _ in range(2000):
        logits = 2.0 * torch.randn(64, generator=g, dtype=torch.float64)
        q = torch.softmax(logits, -1)
        p = torch.softmax(logits + 0.8 * torch.randn(64, generator=g, dtype=torch.float64), -1)
        noise = -torch.log(-torch.log(torch.rand(64, generator=g, dtype=torch.float64)))
        token = int((q.log() + noise).argmax())
        target = int((p.log() + noise).argmax())
        if target == token:
            continue
        noisy = rank_alternatives(q, token, 1, noise)[0][0] == target
        plain = rank_alternatives(q, token, 1)[0][0] == target
        wins += noisy and not plain
        losses += plain and not noisy
    # One-sided sign test: under "no better" P(wins >= observed) for wins + losses fair coins; alpha 0.001.
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n
    assert tail < 1e-3, (wins, losses)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.95, seed=3),
        SamplingParams(temperature=0.9, seed=3, sampling_mode="coupled"),
    ],
    ids=["greedy", "sampled", "coupled"],
)
@pytest.mark.parametrize("threshold", [0.0, 0.02])
def test_a_tree_is_the_chain_with_the_drafts_runners_up_beside_it(draft_model, sampling, threshold):
    """With a tree budget the chain is the chain drafted without one (tokens, q bytes, cache); after it come
    the best runners-up of the draft's own distributions, by path probability (recomputed here from fresh
    prefills), each a sibling of the chain's token at its depth, distinct from it, at or above the threshold,
    up to the node budget; the wire carries the parents and, where rows are sent, a point mass per alternative."""
    model = draft_model.model
    chain_request = DraftRequest("t", PROMPT, gamma=4, sampling=sampling, seed=3)
    chain = ModelProposer(_store(model)).propose(chain_request)
    assert len(chain.token_ids) == 4 and chain.parents == ()
    budget = TreeBudget(10, threshold)
    proposer = ModelProposer(_store(model))
    tree = proposer.propose(dataclasses.replace(chain_request, tree=budget))
    assert tree.token_ids[:4] == chain.token_ids and _wire(tree) == _wire(chain)
    assert proposer.caches.get("t").tokens == PROMPT + chain.token_ids[:-1]
    shape = DraftTree(tree.token_ids, tree.parents)  # valid: distinct siblings, parents first
    assert shape.max_depth == 4 and 4 < shape.nodes <= 10
    assert tree.parents[:4] == (-1, 0, 1, 2)
    # Every candidate's path probability, fresh: the kept ones are the best, none below the threshold.
    seq, above, paths = list(PROMPT), 1.0, {}
    for d, token in enumerate(chain.token_ids):
        ranked = _ranked(model, chain_request, seq)
        noise = gumbel_noise([3], [len(seq)], ranked.shape[-1])[0] if sampling.coupled else None
        for alt, prob in _listed(ranked, token, noise, 11):
            paths[(d, alt)] = above * prob
        above *= float(ranked[token])
        seq.append(token)
    kept = {(shape.depths[i] - 1, tree.token_ids[i]) for i in range(4, shape.nodes)}
    assert kept <= paths.keys()
    assert all(paths[k] >= threshold - 1e-6 for k in kept)
    left = [p for k, p in paths.items() if k not in kept and p >= threshold]
    if shape.nodes < 10:
        assert not [p for p in left if p > threshold + 1e-6], "room was left for a candidate that passes"
    assert max(left, default=0.0) <= min(paths[k] for k in kept) + 1e-6, "a better candidate was left out"
    reply = proposal_pb(ProposeResult(tree, draft_ns=1)).proposal
    assert tuple(reply.parents) == tree.parents and tuple(reply.token_ids) == tree.token_ids
    if tree.probs_f32 is None:
        assert not reply.distributions
    else:
        rows = draft_probs_from_pb(reply.distributions, draft_model.vocab_size)  # what the target rebuilds
        for i in range(4, shape.nodes):
            assert float(rows[i, tree.token_ids[i]]) == 1.0


def test_a_threshold_of_1_a_small_budget_or_a_constraint_gives_the_chain(draft_model):
    model = draft_model.model
    request = DraftRequest("t", PROMPT, gamma=4, sampling=SamplingParams(temperature=0.0), seed=3)
    chain = ModelProposer(_store(model)).propose(request)
    for budget in (TreeBudget(10, 1.0), TreeBudget(4, 0.0), CHAIN):
        got = ModelProposer(_store(model)).propose(dataclasses.replace(request, tree=budget))
        assert (got.token_ids, got.parents) == (chain.token_ids, ()), budget


def test_trees_drafted_in_one_batch_equal_each_drafted_alone(draft_model):
    """A tree is the same alone or batched (tokens, parents, q bytes), as a chain is."""
    requests = [
        dataclasses.replace(r, tree=TreeBudget(r.gamma + 6, 0.01)) for r in _eight_sessions(draft_model.vocab_size)
    ]
    alone = ModelProposer(_store(draft_model.model))
    batched = ModelProposer(_store(draft_model.model))
    by_alone = [alone.propose(r) for r in requests]
    by_batch = batched.propose_batch(requests)
    assert any(a.parents for a in by_alone), "some session branched"
    for r, a, b in zip(requests, by_alone, by_batch, strict=True):
        assert isinstance(b, Drafted)
        assert (b.token_ids, b.parents, _wire(b)) == (a.token_ids, a.parents, _wire(a)), r.session_id
