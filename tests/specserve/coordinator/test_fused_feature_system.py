"""A fused feature head (EAGLE-3's feature) through the whole system: the target projects, the draft reads.

A tiny pair with a fused head (``system_fixtures.tiny_head(fused_layers=...)``) served by the draft tier,
the target making its feature from the same head directory (``TargetSettings.feature_head``). Greedy output
is compared token for token with stock transformers ``generate()`` (the target alone); a pair whose target
makes another feature than the draft's head reads does not start (docs/design.md, "The feature head").
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import system_fixtures as sf

from specserve.api.errors import FailedPrecondition
from specserve.v1 import common_pb2, draft_pb2, target_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

FEATURE = common_pb2.PROPOSER_KIND_FEATURE
PROMPTS = [[5, 17, 33, 2, 91, 14], [40, 41, 42, 43], [100, 3, 250, 8, 19, 27, 64, 5]]
LAYERS = [0, 1, 2]  # the tiny target's three layers


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory, seed=3)


@pytest.fixture(scope="module")
def fused_dir(pair, tmp_path_factory):
    return sf.tiny_head(pair, tmp_path_factory, PROMPTS, fused_layers=LAYERS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, fused_dir, redis_server):
    async with sf.local_stack(
        pair,
        redis_server.url,
        draft_overrides=sf.head_overrides(pair, fused_dir),
        target_overrides={"feature_head": str(fused_dir)},
        coordinator_overrides={"max_batch_size": 8},
    ) as s:
        yield s


@pytest.mark.parametrize("gamma", [1, 4], ids=["gamma1", "gamma4"])
async def test_greedy_with_a_fused_head_is_the_target_alone(stack, pair, gamma):
    """Token-identical to the target alone, and the head's proposals are accepted: it drafts from the fused
    features the target made (that they are exactly its own fusion: tests/specserve/engine/test_feature_maker.py)."""
    outs = await asyncio.gather(
        *(
            sf.generate(stack.address, sf.request(p, max_new_tokens=24, gamma=gamma, proposer=FEATURE))
            for p in PROMPTS
        )
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 24)
        assert out.stats.proposer == FEATURE
    accepted = sum(o.stats.accepted_tokens for o in outs)
    proposed = sum(o.stats.proposed_tokens for o in outs)
    assert proposed > 0 and accepted / proposed > 0.3, (accepted, proposed)


async def test_both_tiers_name_the_fused_feature_and_the_wire_keeps_hidden_values(stack, pair):
    """GetTargetInfo and GetDraftInfo name one fused feature (its layers, width and projection)."""
    import grpc

    from specserve.v1 import draft_pb2_grpc, target_pb2_grpc

    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{stack.target_ports[0]}") as t,
        grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft_port}") as d,
    ):
        made = (
            await target_pb2_grpc.TargetServiceStub(t).GetTargetInfo(target_pb2.GetTargetInfoRequest())
        ).feature
        read = (
            await draft_pb2_grpc.DraftServiceStub(d).GetDraftInfo(draft_pb2.GetDraftInfoRequest())
        ).feature
    assert made == read and made.startswith("fused_layers=0,1,2 hidden=48 fuse=")


@pytest.mark.parametrize("target_head", [None, "last"], ids=["target-unset", "target-last-layer-head"])
async def test_a_target_that_makes_another_feature_than_the_drafts_head_reads_does_not_start(
    pair, fused_dir, tmp_path_factory, redis_server, target_head
):
    """The draft serves the fused head; a target left to the last layer's feature (unset, not the default
    target), or pointed at a last-layer head, makes another: the coordinator refuses at start-up, naming both."""
    target_overrides = {}
    if target_head == "last":
        target_overrides["feature_head"] = str(sf.tiny_head(pair, tmp_path_factory, PROMPTS))
    with pytest.raises(FailedPrecondition) as refused:
        async with sf.local_stack(
            pair,
            redis_server.url,
            draft_overrides=sf.head_overrides(pair, fused_dir),
            target_overrides=target_overrides,
        ):
            pass
    message = refused.value.message
    assert "reads the feature 'fused_layers=0,1,2 hidden=48 fuse=" in message
    assert "returns 'last_hidden_rms hidden=48'" in message and "feature_head" in message
