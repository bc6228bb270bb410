"""The verifier's features (VerifyItem.features_from): the target's features of the positions it committed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from target_helpers import greedy_continuation, item, make_verifier, new_session

from specserve.core import features as wire
from specserve.engine.feature_head import FinalNormInput, head_from_target, save_feature_head
from specserve.engine.feature_maker import FeatureMaker, features_of
from specserve.engine.models import LoadedModel
from specserve.target.messages import VerifyBatch

PROMPT = (5, 17, 42, 99, 3, 250, 7, 11, 64, 120)


@torch.no_grad()
def fresh_features(model: LoadedModel, tokens: Sequence[int]) -> torch.Tensor:
    """``[len(tokens), hidden]``: the target's features of ``tokens`` from one fresh pass."""
    with FinalNormInput(model.model) as tap:
        model.model(input_ids=torch.tensor([list(tokens)]))
    return features_of(model.model, tap.hidden[0])


def asking(record, tokens=(), *, start: int):
    return dataclasses.replace(item(record, tokens), features_from=start)


def assert_rows(block: wire.FeatureBlock, model: LoadedModel, committed: Sequence[int], start: int) -> None:
    """``block`` holds the features of positions [start, len(committed) - 1), to float16 rounding."""
    assert (block.start, block.stop) == (start, len(committed) - 1)
    expected = fresh_features(model, committed[:-1])[start:]
    torch.testing.assert_close(wire.decode(block), expected, atol=2e-3, rtol=2e-3)


async def test_features_of_every_committed_position_round_after_round(target, store):
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT)
    proposal = greedy_continuation(target, PROMPT, 3)
    result = (await verifier.verify(VerifyBatch(items=(asking(record, proposal, start=0),)))).results[0]
    committed = PROMPT + tuple(result.verdict.committed_token_ids)
    assert result.verdict.accepted_count == 3
    assert_rows(result.features, target, committed, 0)
    record = await store.load(record.session_id)
    stop = result.features.stop
    result = (await verifier.verify(VerifyBatch(items=(asking(record, start=stop),)))).results[0]
    committed += tuple(result.verdict.committed_token_ids)
    assert_rows(result.features, target, committed, stop)


async def test_batched_items_get_the_features_they_get_alone(target, store):
    verifier = make_verifier(target, store, inline_catchup_max=4)
    prompts = [PROMPT, PROMPT[:3], (8, 9) * 9]
    records = [await new_session(store, p) for p in prompts]
    items = tuple(asking(r, greedy_continuation(target, p, 2), start=0) for r, p in zip(records, prompts, strict=True))
    results = (await verifier.verify(VerifyBatch(items=items))).results
    for r, p in zip(results, prompts, strict=True):
        assert_rows(r.features, target, p + tuple(r.verdict.committed_token_ids), 0)


async def test_items_that_do_not_ask_get_none_and_a_session_that_starts_asking_gets_all(target, store):
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT)
    result = (await verifier.verify(VerifyBatch(items=(item(record),)))).results[0]
    assert result.features is None
    assert not verifier.caches.get(record.session_id).tracks_features
    record = await store.load(record.session_id)
    result = (await verifier.verify(VerifyBatch(items=(asking(record, start=0),)))).results[0]
    assert_rows(result.features, target, record.token_ids + tuple(result.verdict.committed_token_ids), 0)


async def test_a_replayed_verdict_carries_no_features(target, store):
    verifier = make_verifier(target, store)
    record = await new_session(store, PROMPT)
    first = (await verifier.verify(VerifyBatch(items=(asking(record, start=0),)))).results[0]
    again = (await verifier.verify(VerifyBatch(items=(asking(record, start=0),)))).results[0]
    assert again.replayed and again.verdict == first.verdict
    assert again.features is None and first.features is not None


LONG = tuple((7 * i + 3) % 250 + 1 for i in range(40))  # two whole blocks of 16 and 8 tokens more


async def test_a_session_that_asks_for_features_attaches_the_prefix_cache_and_gets_its_features(target, store):
    """The prefix cache with the feature head (issue 53): a feature session's shared blocks keep the features
    they produced, so the next turn attaches them (``cached_tokens``), is not fed them again, and still gets
    the features of every position it asks for; ``features_from_uncached`` starts them at the hit's last block."""
    verifier = make_verifier(target, store)
    first = await new_session(store, LONG)
    done = (await verifier.verify(VerifyBatch(items=(asking(first, start=0),)))).results[0]
    history = LONG + tuple(done.verdict.committed_token_ids)
    turn2 = (*history, 9, 8, 7)
    for uncached in (False, True):
        record = await new_session(store, turn2)
        ask = dataclasses.replace(asking(record, start=0), features_from_uncached=uncached)
        batch = await verifier.verify(VerifyBatch(items=(ask,)))
        result = batch.results[0]
        assert result.cached_tokens == 32
        assert batch.positions_processed == len(turn2) - 32  # the history's blocks are not fed again
        committed = turn2 + tuple(result.verdict.committed_token_ids)
        assert_rows(result.features, target, committed, 16 if uncached else 0)  # the hit's last block on


async def test_a_reply_holds_at_most_its_feature_budget_shared_fairly_and_the_rest_comes_later(target, store):
    """Bounded features (issue 54, finding 4): three long prompts in one call get rows within the budget, the
    short one all of its own, the long ones equal shares of the rest; the next calls bring the rest, in order."""
    hidden = target.model.config.get_text_config(decoder=True).hidden_size
    row = hidden * wire.VALUE_BYTES
    verifier = make_verifier(target, store)
    verifier.features_per_call_bytes = 60 * row
    prompts = [PROMPT[:4], LONG, LONG[::-1] + LONG]
    records = [await new_session(store, p) for p in prompts]
    batch = await verifier.verify(VerifyBatch(items=tuple(asking(r, start=0) for r in records)))
    got = [r.features for r in batch.results]
    assert sum(len(block.data) for block in got) <= 60 * row
    assert [block.count for block in got] == [4, 28, 28]  # 4 rows in all for the short one
    for r, p, block in zip(batch.results, prompts, got, strict=True):
        committed = p + tuple(r.verdict.committed_token_ids)
        expected = fresh_features(target, committed[:-1])[: block.count]
        torch.testing.assert_close(wire.decode(block), expected, atol=2e-3, rtol=2e-3)
    # The long ones ask on from where their rows ended, one at a time and within their own limit.
    record = await store.load(records[2].session_id)
    capped = dataclasses.replace(asking(record, start=got[2].stop), features_max_bytes=10 * row)
    more = (await verifier.verify(VerifyBatch(items=(capped,)))).results[0].features
    assert (more.start, more.count) == (got[2].stop, 10)


async def test_a_fused_heads_features_come_from_a_lone_pass_and_a_batched_one_alike(llama_target, store, tmp_path):
    """With a fused head's maker (the target's ``feature_head``), a session's features are that head's fused
    feature of the positions it committed, from a lone session's pass and from a batch's."""
    model = llama_target.model
    torch.manual_seed(5)
    head = head_from_target(model, torch.arange(model.config.vocab_size), fused_layers=[0, 1, 2])
    with torch.no_grad():
        head.fuse.weight.add_(0.3 * torch.randn_like(head.fuse.weight))
    save_feature_head(head.eval(), tmp_path, dtype=torch.float32)
    maker = FeatureMaker.for_head(model, tmp_path)
    verifier = make_verifier(llama_target, store, inline_catchup_max=4, feature_maker=maker)

    def fused(tokens: Sequence[int]) -> torch.Tensor:
        with torch.no_grad(), maker.tap() as tap:
            model(input_ids=torch.tensor([list(tokens)]))
        return tap.rows(0, len(tokens))

    prompts = [PROMPT, PROMPT[:3], (8, 9) * 9]
    records = [await new_session(store, p) for p in prompts]
    lone = (await verifier.verify(VerifyBatch(items=(asking(records[0], start=0),)))).results[0]
    items = tuple(
        asking(r, greedy_continuation(llama_target, p, 2), start=0)
        for r, p in zip(records[1:], prompts[1:], strict=True)
    )
    batched = (await verifier.verify(VerifyBatch(items=items))).results
    for r, p in zip((lone, *batched), prompts, strict=True):
        committed = p + tuple(r.verdict.committed_token_ids)
        assert (r.features.start, r.features.stop) == (0, len(committed) - 1)
        expected = fused(committed[:-1])
        torch.testing.assert_close(wire.decode(r.features), expected, atol=2e-3, rtol=2e-3)
        assert not torch.allclose(wire.decode(r.features), fresh_features(llama_target, committed[:-1]), atol=0.05)
