"""The feature head through the whole system: exact, the default where served, and refused where not.

A tiny pair with a head trained briefly on the target's own greedy text
(``system_fixtures.tiny_head``), served by the draft tier, the target's features
relayed by the coordinator (docs/design.md, "The feature head"). Greedy output
is compared token for token with stock transformers ``generate()`` (the target
alone); coupled sampling with the target's own Gumbel-max reference. The same
with draft trees from the head's own ranking (every runner-up kept up to the
node budget: ``draft_tree_min_path_probability=0``).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from prometheus_client import REGISTRY

from specserve import AsyncClient
from specserve.coordinator.speculation.policy import AdaptiveGamma
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

FEATURE = common_pb2.PROPOSER_KIND_FEATURE
MODEL = common_pb2.PROPOSER_KIND_MODEL
PROMPTS = [[5, 17, 33, 2, 91, 14], [40, 41, 42, 43], [7] * 9, [100, 3, 250, 8, 19, 27, 64, 5]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory, seed=3)


@pytest.fixture(scope="module")
def head_dir(pair, tmp_path_factory):
    return sf.tiny_head(pair, tmp_path_factory, PROMPTS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, head_dir, redis_server):
    async with sf.local_stack(
        pair,
        redis_server.url,
        draft_overrides=sf.head_overrides(pair, head_dir),
        coordinator_overrides={"max_batch_size": 8, "default_proposer": "auto"},
    ) as s:
        yield s


def _proposed(proposer: str) -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_proposals_total", {"proposer": proposer}) or 0.0


@pytest.mark.parametrize("gamma", [1, 4, None], ids=["gamma1", "gamma4", "adaptive"])
async def test_greedy_with_the_head_is_the_target_alone(stack, pair, gamma):
    """Greedy with proposer="feature" is token-identical to the target alone, and the head's proposals are
    accepted (the features reach it: a head drafting blind would rarely match the trained continuation)."""
    before = _proposed("feature")
    outs = await asyncio.gather(
        *(sf.generate(stack.address, sf.request(p, max_new_tokens=24, gamma=gamma, proposer=FEATURE)) for p in PROMPTS)
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 24)
    if gamma is not None:
        assert _proposed("feature") > before, "the feature head (in the draft tier) proposed"
        accepted = sum(o.stats.accepted_tokens for o in outs)
        proposed = sum(o.stats.proposed_tokens for o in outs)
        assert proposed > 0 and accepted / proposed > 0.3, (accepted, proposed)


async def test_the_head_is_the_default_request_where_the_draft_serves_it(stack, pair):
    """A request that names no proposer drafts with the head under ``default_proposer='auto'``: its
    acceptance matches an explicit proposer="feature" request's exactly (both greedy, same prompt)."""
    prompt = PROMPTS[0]
    default = await sf.generate(
        stack.address, sf.request(prompt, max_new_tokens=24, gamma=3, proposer=common_pb2.PROPOSER_KIND_UNSPECIFIED)
    )
    explicit = await sf.generate(stack.address, sf.request(prompt, max_new_tokens=24, gamma=3, proposer=FEATURE))
    model = await sf.generate(
        stack.address, sf.request(prompt, max_new_tokens=24, gamma=3, proposer=common_pb2.PROPOSER_KIND_MODEL)
    )
    assert default.token_ids == explicit.token_ids == model.token_ids
    # The statistics name the proposer the session drafted with, the server's default included.
    assert (default.stats.proposer, explicit.stats.proposer, model.stats.proposer) == (FEATURE, FEATURE, MODEL)
    assert (default.stats.accepted_tokens, default.stats.proposed_tokens) == (
        explicit.stats.accepted_tokens,
        explicit.stats.proposed_tokens,
    )


def _feature_bytes(hop: str) -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_feature_bytes_total", {"hop": hop}) or 0.0


async def test_the_coordinator_counts_the_feature_bytes_it_relays_and_no_others(stack, pair, head_dir):
    """``specserve_coordinator_feature_bytes_total`` (what the benchmark's bytes per committed token are
    read from): a feature session's rows, whole float16 rows of the target's hidden size, each committed
    position at most once per hop (no failover here), and never more to the draft than came from the
    target; a token-draft session relays none."""
    import json

    hidden = json.loads((pair.target_dir / "config.json").read_text())["hidden_size"]
    row = hidden * 2
    prompt = PROMPTS[3]
    before = {hop: _feature_bytes(hop) for hop in ("to_draft", "from_target")}
    out = await sf.generate(stack.address, sf.request(prompt, max_new_tokens=16, gamma=2, proposer=FEATURE))
    got = {hop: _feature_bytes(hop) - before[hop] for hop in before}
    positions = len(prompt) + len(out.token_ids)
    assert out.stats.proposed_tokens > 0
    assert got["to_draft"] > 0 and got["to_draft"] % row == 0 and got["from_target"] % row == 0, got
    assert got["to_draft"] <= got["from_target"] <= positions * row, (got, positions)
    before = {hop: _feature_bytes(hop) for hop in before}
    model = await sf.generate(
        stack.address, sf.request(prompt, max_new_tokens=16, gamma=2, proposer=common_pb2.PROPOSER_KIND_MODEL)
    )
    assert model.stats.proposed_tokens > 0
    assert {hop: _feature_bytes(hop) - before[hop] for hop in before} == {"to_draft": 0.0, "from_target": 0.0}


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_coupled_mode_gives_the_same_text_with_the_head_as_with_the_token_draft(stack, pair, seed):
    prompt = PROMPTS[1]
    outs = [
        await sf.generate(
            stack.address,
            sf.request(
                prompt,
                max_new_tokens=20,
                temperature=0.7,
                seed=seed,
                gamma=3,
                proposer=proposer,
                ignore_eos=True,
                sampling_mode=common_pb2.SAMPLING_MODE_COUPLED,
            ),
        )
        for proposer in (FEATURE, common_pb2.PROPOSER_KIND_MODEL, common_pb2.PROPOSER_KIND_NGRAM)
    ]
    reference = sf.reference_coupled(pair.target_dir, prompt, 20, seed=seed, temperature=0.7)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids == reference


async def test_logprobs_with_the_head(stack, pair):
    """Logprobs keep working with the head: one entry per token, the target's own values."""
    prompt = PROMPTS[2]
    want = sf.reference_greedy(pair.target_dir, prompt, 16, ignore_eos=True)
    async with AsyncClient(stack.address) as client:
        result = await client.generate(
            prompt_token_ids=prompt,
            max_new_tokens=16,
            temperature=0,
            ignore_eos=True,
            gamma=2,
            proposer="feature",
            logprobs=True,
            top_logprobs=3,
        )
    assert list(result.token_ids) == want
    assert result.stats.accepted_tokens > 0
    sf.check_logprobs(result.logprobs, want, sf.reference_logprobs(pair.target_dir, prompt, want), 3)


async def test_eight_concurrent_streams_with_the_head_are_each_exact(stack, pair):
    prompts = [[(11 * i + j) % 380 + 1 for j in range(5 + i)] for i in range(8)]
    outs = await asyncio.gather(
        *(sf.generate(stack.address, sf.request(p, max_new_tokens=20, gamma=4, proposer=FEATURE)) for p in prompts)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 20)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tree_stack(pair, head_dir, redis_server):
    overrides = {"max_batch_size": 8, "draft_tree_nodes": 6, "draft_tree_min_path_probability": 0.0}
    async with sf.local_stack(
        pair, redis_server.url, draft_overrides=sf.head_overrides(pair, head_dir), coordinator_overrides=overrides
    ) as s:
        yield s


@pytest.mark.parametrize("gamma", [1, 4, None], ids=["gamma1", "gamma4", "adaptive"])
async def test_greedy_with_head_trees_is_the_target_alone(tree_stack, pair, gamma):
    """Greedy with the head's trees is token-identical to the target alone, four sessions at once; at a fixed
    gamma every drafting round proposes the chain and its runners-up (more nodes than levels), and the
    accepted tokens per position never outnumber the levels a round reaches; at gamma 4 the head expands below
    its runners-up (the threshold fixed at 0 expands at any price), and the draft's reports of those passes reach
    the coordinator's count."""
    prompts = [*PROMPTS, *([(11 * i + j) % 380 + 1 for j in range(5 + i)] for i in range(4))]
    requests = [sf.request(p, max_new_tokens=24, gamma=gamma, proposer=FEATURE) for p in prompts]
    expanded = _expansion_passes()
    outs = await asyncio.gather(*(sf.generate(tree_stack.address, r) for r in requests))
    if gamma == 4:
        assert _expansion_passes() > expanded
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 24)
        assert len(out.stats.accepted_per_position) <= (gamma or 16)
    if gamma is not None:
        drafted = [o.stats for o in outs if o.stats.draft_rounds]
        assert drafted and all(s.proposed_tokens > gamma * s.draft_rounds for s in drafted)
        assert sum(s.accepted_tokens for s in drafted) > 0


def _expansion_passes() -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_draft_expansion_passes_total") or 0.0


def _branch_nodes() -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_branch_nodes_total", {"source": "ngram"}) or 0.0


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "coupled"])
async def test_the_lookups_branches_on_head_trees_keep_the_target_alones_text(
    tree_stack, pair, temperature, monkeypatch
):
    """The hybrid lookup hangs its continuation on the head's trees (docs/design.md, "Free branches"), and the
    output is still the target alone's, greedy and coupled. The lookup exists only under the adaptive policy,
    which on this tiny pair rarely drafts with the head: the session's own rounds are held at gamma 3 (the
    lookup's own choice is the policy's)."""
    choose = AdaptiveGamma.choose_gamma

    def drafting(self, acceptance, load, *, local_draft=False, target_only_steps=None):
        chosen = choose(self, acceptance, load, local_draft=local_draft, target_only_steps=target_only_steps)
        return chosen if local_draft else 3

    monkeypatch.setattr(AdaptiveGamma, "choose_gamma", drafting)
    prompts = [*PROMPTS, [7, 8, 9, 7, 8, 9, 7, 8], [5, 6, 5, 6, 5, 6, 5, 6, 5]]
    before = _branch_nodes()
    coupled = {"seed": 1, "sampling_mode": common_pb2.SAMPLING_MODE_COUPLED, "ignore_eos": True} if temperature else {}
    requests = [sf.request(p, max_new_tokens=32, temperature=temperature, proposer=FEATURE, **coupled) for p in prompts]
    outs = await asyncio.gather(*(sf.generate(tree_stack.address, r) for r in requests))
    for prompt, out in zip(prompts, outs, strict=True):
        if temperature:
            assert out.token_ids == sf.reference_coupled(pair.target_dir, prompt, 32, seed=1, temperature=temperature)
        else:
            assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 32)
    assert _branch_nodes() > before, "the lookup's guesses were hung on the head's trees"


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_coupled_mode_with_head_trees_gives_the_target_alones_text(tree_stack, pair, seed):
    prompt = PROMPTS[1]
    request = sf.request(
        prompt,
        max_new_tokens=20,
        temperature=0.7,
        seed=seed,
        gamma=3,
        proposer=FEATURE,
        ignore_eos=True,
        sampling_mode=common_pb2.SAMPLING_MODE_COUPLED,
    )
    out = await sf.generate(tree_stack.address, request)
    assert out.token_ids == sf.reference_coupled(pair.target_dir, prompt, 20, seed=seed, temperature=0.7)
    assert out.stats.proposed_tokens > 3 * out.stats.draft_rounds > 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def headless(pair, redis_server):
    async with sf.local_stack(pair, redis_server.url) as s:
        yield s


async def test_without_a_head_proposer_feature_is_refused_and_the_default_is_the_token_draft(headless, pair):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sf.generate(headless.address, sf.request(PROMPTS[0], max_new_tokens=4, proposer=FEATURE))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "feature head" in info.value.details()
    out = await sf.generate(
        headless.address,
        sf.request(PROMPTS[0], max_new_tokens=16, gamma=2, proposer=common_pb2.PROPOSER_KIND_UNSPECIFIED),
    )
    assert out.token_ids == sf.reference_greedy(pair.target_dir, PROMPTS[0], 16)
    assert out.stats.proposed_tokens > 0 and out.stats.proposer == common_pb2.PROPOSER_KIND_MODEL
