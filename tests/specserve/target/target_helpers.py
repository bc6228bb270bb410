"""Helpers of the target-service tests: sessions in Redis, reference computations on the models."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specserve.api.params import SamplingParams, SessionBase, StopConditions
from specserve.core.proposal import DraftProposal
from specserve.core.sampling import logits_to_probs
from specserve.engine.feature_maker import FeatureMaker
from specserve.engine.kvcache import SessionCacheStore
from specserve.engine.models import LoadedModel
from specserve.runtime.store import SessionRecord, SessionStore
from specserve.target.messages import ItemResult, ItemToVerify, VerifyBatch
from specserve.target.verifier import Verifier

ATOL = 1e-4
NAN_AT = 40  # the poisoned target's position embedding NAN_AT is NaN (conftest.py, poisoned_target)
GREEDY = SamplingParams(temperature=0.0)


async def new_session(
    store: SessionStore,
    prompt: Sequence[int],
    sampling: SamplingParams = GREEDY,
    stop: StopConditions | None = None,
    prefix: str = "s",
) -> SessionRecord:
    stop = stop or StopConditions(max_new_tokens=64, ignore_eos=True)
    return await store.create(f"{prefix}-{uuid.uuid4().hex[:12]}", tuple(prompt), sampling, stop)


def make_verifier(
    model: LoadedModel,
    store: SessionStore,
    *,
    max_sessions: int = 64,
    inline_catchup_max: int = 32,
    feature_maker: FeatureMaker | None = None,
) -> Verifier:
    caches = SessionCacheStore(
        model.model, max_sessions=max_sessions, budget_bytes=1 << 30, ttl_s=600, feature_maker=feature_maker
    )
    return Verifier(model, caches, store, inline_catchup_max=inline_catchup_max)


def item(
    record: SessionRecord,
    tokens: Sequence[int] = (),
    probs: torch.Tensor | None = None,
    *,
    top_logprobs: int | None = None,
) -> ItemToVerify:
    base = SessionBase(record.session_id, record.committed_len, record.version)
    return ItemToVerify(
        base=base, proposal=DraftProposal(token_ids=tuple(tokens), probs=probs), top_logprobs=top_logprobs
    )


async def verify_one(verifier: Verifier, record: SessionRecord, tokens=(), probs=None) -> ItemResult:
    result = await verifier.verify(VerifyBatch(items=(item(record, tokens, probs),)))
    return result.results[0]


@torch.no_grad()
def fresh_logits(model: LoadedModel, tokens: Sequence[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` float32 logits of a fresh prefill (no cache)."""
    return model.model(input_ids=torch.tensor([list(tokens)])).logits[0].float()


@torch.no_grad()
def fresh_kv(model: LoadedModel, tokens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = DynamicCache(config=model.model.config)
    model.model(input_ids=torch.tensor([list(tokens)]), cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def next_probs(model: LoadedModel, tokens: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """The target-only processed distribution of the token after ``tokens``: ``[vocab]`` float64."""
    logits = fresh_logits(model, tokens)[-1:]
    return logits_to_probs(logits, params, [tuple(tokens)])[0]


def greedy_continuation(model: LoadedModel, tokens: Sequence[int], k: int, params=GREEDY) -> list[int]:
    """``k`` tokens of target-only greedy decoding after ``tokens`` (fresh prefill each step)."""
    seq = list(tokens)
    for _ in range(k):
        seq.append(int(next_probs(model, seq, params).argmax()))
    return seq[len(tokens) :]


def assert_cache_holds(verifier: Verifier, session_id: str, committed: Sequence[int]) -> None:
    """The session's cache holds exactly ``committed[:-1]`` (the pending token aside), with KV and next-step
    logits equal to a fresh prefill of ``committed`` within ATOL; the cache is left as found."""
    cache = verifier.caches.get(session_id)
    assert cache is not None, f"no cache for {session_id}"
    assert cache.tokens == tuple(committed[:-1])
    assert cache.committed_len == len(committed) - 1
    for (k, v), (fk, fv) in zip(cache.layer_kv(), fresh_kv(verifier.model, committed[:-1]), strict=True):
        torch.testing.assert_close(k, fk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, fv, atol=ATOL, rtol=0)
    step = cache.extend([committed[-1]])[-1]  # the next step's logits, from the cache
    torch.testing.assert_close(step, fresh_logits(verifier.model, committed)[-1], atol=ATOL, rtol=0)
    cache.truncate(len(committed) - 1)


def hf_logprobs(model: LoadedModel, tokens: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """``[vocab]`` float64: log of the target-only processed distribution of the token after ``tokens``, by
    Hugging Face's own processors (greedy: the repetition penalty alone, softmax at temperature 1)."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0.0:
            processors.append(MinPLogitsWarper(params.min_p))
    logits = fresh_logits(model, tokens)[-1:]  # [1, vocab]
    scores = processors(torch.tensor([list(tokens)]), logits)
    return torch.log_softmax(scores.double(), dim=-1)[0]
