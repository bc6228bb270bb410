"""draft_service.proposers: the draft distribution, prompt lookup, and the model proposer's cache."""

from __future__ import annotations

import pytest
import torch

from draft_service.proposers import (
    DraftRequest,
    ModelProposer,
    NgramProposer,
    draft_distribution,
    ngram_lookup,
)
from specserve.kvcache import SessionCacheStore
from specserve.params import SamplingParams
from specserve.rng import Purpose, uniform
from specserve.sampling import check_distribution, logits_to_probs, sample_from

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


@pytest.mark.parametrize(
    ("tokens", "gamma", "expected"),
    [
        ((1, 2, 3, 4, 5, 6, 1, 2, 3), 3, (4, 5, 6)),  # 3-gram match
        ((1, 2, 3, 4, 5, 6, 1, 2, 3), 10, (4, 5, 6, 1, 2, 3)),  # runs up to the end of the history
        ((9, 2, 3, 7, 8, 1, 2, 3, 5, 6, 2, 3), 2, (5, 6)),  # the latest of two occurrences
        ((4, 9, 9, 1, 8, 9), 2, (1, 8)),  # no 3- or 2-gram match: the 1-gram 9, latest at index 2
        ((1, 2, 3), 4, ()),  # nothing repeats
        ((7,), 4, ()),
        ((1, 2, 1, 2), 0, ()),
    ],
)
def test_ngram_lookup(tokens, gamma, expected):
    assert ngram_lookup(tokens, gamma) == expected


def test_ngram_proposer_prefers_the_longest_match():
    # The 1-gram "3" last occurred before 9, the 3-gram "1 2 3" before 4: the longer match wins.
    tokens = (1, 2, 3, 4, 0, 5, 3, 9, 1, 2, 3)
    drafted = NgramProposer().propose(DraftRequest("s", tokens, gamma=2, sampling=SamplingParams(), seed=0))
    assert drafted.token_ids == (4, 0) and drafted.probs_f32 is None
    only_unigrams = NgramProposer(max_n=1).propose(
        DraftRequest("s", tokens, gamma=2, sampling=SamplingParams(), seed=0)
    )
    assert only_unigrams.token_ids == (9, 1)


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


def test_model_proposer_stops_at_the_context_limit(draft_model):
    store = SessionCacheStore(draft_model.model, max_sessions=4, budget_bytes=10**9, ttl_s=60)
    limit = store.get_or_create("probe")[0].max_positions
    assert limit == 512  # the tiny models' max_position_embeddings
    committed = tuple((7 * i) % 300 + 1 for i in range(limit - 2))
    drafted = ModelProposer(store).propose(
        DraftRequest("long", committed, gamma=5, sampling=SamplingParams(temperature=0.0), seed=0)
    )
    assert len(drafted.token_ids) == 2  # C + x1 + x2 fills the context exactly
