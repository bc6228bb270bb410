"""Distribution end to end with the feature head drafting: target-only sampling, and a biased head rejected.

The 4-token pair of ``test_rounds_distribution`` (EOS an ordinary token), a
head for its target (``system_fixtures.tiny_head``), ``proposer="feature"``,
gamma 2, temperature 0.7, the optimal rule (rejection sampling against the q
the head ships). N = 800 seeded sessions of 3 tokens each (the first round is
the prefill, which brings the head its features; the next drafts the other
two). The empirical joint of the 3 tokens against the target's exact joint by
enumeration: Pearson chi-square, cells with expected count < 5 merged,
significance level 0.001; with chains, and with draft trees from the head's
own ranking (every runner-up of its q a point-mass sibling: the coordinator's
``draft_tree_min_path_probability=0``); and with trees over N = 2000 sessions of 4
tokens, whose drafting round has the depth for the nodes the head expands below
its alternatives. For power, the same test runs against a
deliberately biased head that proposes the mode of its q while shipping q (a
proposal that is not a draw from the q it reports): it must fail. And once more
with the hybrid lookup's continuation hung on the trees as point masses.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import pytest_asyncio
import system_fixtures as sf
from prometheus_client import REGISTRY

import specserve.draft.feature_proposer
import specserve.draft.proposers
from specserve.api.params import SamplingParams
from specserve.coordinator.speculation.policy import AdaptiveGamma
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

VOCAB = 4
PROMPT = (1, 2, 3, 1)
LENGTH = 3
N = 800
ALPHA = 0.001
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_vocab_pair(tmp_path_factory, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def head(pair, tmp_path_factory):
    # The head as initialised, untrained: a soft q unlike the target's p (a head trained to memorise is
    # nearly one-hot, its samples are its mode anyway, and the biased variant below would change nothing).
    return sf.tiny_head(pair, tmp_path_factory, [PROMPT], length=4, steps=0)


CHAINS = {"max_batch_size": 32}
TREES = {**CHAINS, "draft_tree_nodes": 8, "draft_tree_min_path_probability": 0.0}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[CHAINS, TREES], ids=["chains", "trees"])
async def stack(pair, head, redis_server, request):
    async with sf.local_stack(
        pair,
        redis_server.url,
        draft_overrides=sf.head_overrides(pair, head),
        coordinator_overrides=request.param,
    ) as s:
        yield s


async def _sample(stack, stats: list, gamma: int | None = 2, length: int = LENGTH, n: int = N) -> Counter:
    sem = asyncio.Semaphore(64)

    async def one(seed: int) -> tuple[int, ...]:
        async with sem:
            req = sf.request(
                PROMPT,
                max_new_tokens=length,
                temperature=TEMPERATURE,
                seed=seed,
                gamma=gamma,
                ignore_eos=True,
                proposer=common_pb2.PROPOSER_KIND_FEATURE,
                sampling_mode=common_pb2.SAMPLING_MODE_OPTIMAL,
            )
            out = await sf.generate(stack.address, req)
            stats.append(out.stats)
            return tuple(out.token_ids[:length])

    return Counter(await asyncio.gather(*(one(seed) for seed in range(n))))


async def test_the_joint_with_the_head_is_target_only_sampling(stack, pair, request):
    trees = request.node.callspec.id == "trees"
    exact = sf.exact_joint(pair.target_dir, PROMPT, SamplingParams(temperature=TEMPERATURE), LENGTH)
    stats: list = []
    observed = await _sample(stack, stats)
    assert sum(observed.values()) == N and all(seq in exact for seq in observed)
    stat, p, cells = sf.merged_chi_square(observed, exact)
    print(f"feature head, {request.node.callspec.id}: chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"
    assert sum(s.proposed_tokens for s in stats) >= N, "the head drafted (the test exercises it)"
    # With trees a drafting round proposes more nodes than its gamma of 2 levels: the runners-up beside them.
    branched = sum(s.proposed_tokens for s in stats) > 2 * sum(s.draft_rounds for s in stats)
    assert branched == trees


#: Sessions of 4 tokens: the round after the prefill drafts 2 levels, so the second holds the chain's runners-up
#: and the children below the first level's alternatives (EAGLE-2's expansion, docs/design.md, "Expansion below
#: the alternatives"), which 3-token sessions never reach. 4^4 joint cells: more sessions.
DEEP, N_DEEP = 4, 2000


@pytest.mark.parametrize("stack", [TREES], ids=["trees"], indirect=True)
async def test_the_joint_through_nodes_expanded_below_the_alternatives_is_target_only_sampling(
    stack, pair, monkeypatch
):
    grown = {"trees": 0, "expanded": 0}
    grow = specserve.draft.proposers.grow_tree

    def counted(chain, *args, **kwargs):
        tokens, parents = grow(chain, *args, **kwargs)
        grown["trees"] += 1
        grown["expanded"] += any(parent >= len(chain) for parent in parents)  # below a non-chain node
        return tokens, parents

    monkeypatch.setattr(specserve.draft.proposers, "grow_tree", counted)
    exact = sf.exact_joint(pair.target_dir, PROMPT, SamplingParams(temperature=TEMPERATURE), DEEP)
    observed = await _sample(stack, [], length=DEEP, n=N_DEEP)
    assert sum(observed.values()) == N_DEEP and all(seq in exact for seq in observed)
    stat, p, cells = sf.merged_chi_square(observed, exact)
    print(f"feature head, expanded trees ({grown}): chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"
    assert grown["expanded"] >= N_DEEP / 4, f"nodes below the alternatives were on many trees: {grown}"


#: One runner-up per tree (the chain's token and one more at depth 1 of 4 tokens): room for the lookup's guess.
BRANCHES = {**CHAINS, "draft_tree_nodes": 1, "draft_tree_min_path_probability": 0.0}


@pytest.mark.parametrize("stack", [BRANCHES], ids=["branches"], indirect=True)
async def test_the_joint_with_the_lookups_branches_on_head_trees_is_target_only_sampling(stack, pair, monkeypatch):
    """The same test where the hybrid lookup hangs its guesses on the head's trees (docs/design.md, "Free
    branches"): the lookup exists only under the adaptive policy, whose session rounds are held at gamma 2 here
    (its own choice for the lookup's rounds is the policy's)."""
    choose = AdaptiveGamma.choose_gamma

    def drafting(self, acceptance, load, *, local_draft=False, target_only_steps=None):
        chosen = choose(self, acceptance, load, local_draft=local_draft, target_only_steps=target_only_steps)
        return chosen if local_draft else 2

    monkeypatch.setattr(AdaptiveGamma, "choose_gamma", drafting)
    exact = sf.exact_joint(pair.target_dir, PROMPT, SamplingParams(temperature=TEMPERATURE), LENGTH)
    before = REGISTRY.get_sample_value("specserve_coordinator_branch_nodes_total", {"source": "ngram"}) or 0.0
    observed = await _sample(stack, [], gamma=None)
    branched = (REGISTRY.get_sample_value("specserve_coordinator_branch_nodes_total", {"source": "ngram"}) or 0.0) - before
    assert sum(observed.values()) == N and all(seq in exact for seq in observed)
    stat, p, cells = sf.merged_chi_square(observed, exact)
    print(f"feature head, trees and the lookup's branches ({branched:.0f} nodes): chi-square {stat:.1f}, p = {p:.3g}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"
    assert branched >= N / 4, "the lookup's branches were on many of the trees"


def _mode_of_q(draw_step):
    def biased(rows, last):
        going = draw_step(rows, last)
        for row in rows:
            if row.shipped and len(row.shipped) == len(row.tokens):  # a sampled row: propose q's mode instead
                row.tokens[-1] = row.context[-1] = int(row.shipped[-1].argmax())
        return going

    return biased


@pytest.mark.parametrize(
    ("stack", "length", "n"), [(CHAINS, LENGTH, N), (TREES, DEEP, N_DEEP)], ids=["chains", "expanded-trees"],
    indirect=["stack"],
)  # fmt: skip
async def test_the_same_test_rejects_a_head_that_proposes_its_mode(stack, pair, monkeypatch, length, n):
    """Power: the chain's token replaced by q's mode, q shipped as drawn; with trees, the 4-token test above
    (the alternatives and the nodes below them are the tree's as before, around the biased chain)."""
    exact = sf.exact_joint(pair.target_dir, PROMPT, SamplingParams(temperature=TEMPERATURE), length)
    module = specserve.draft.feature_proposer
    monkeypatch.setattr(module, "draw_step", _mode_of_q(module.draw_step))
    observed = await _sample(stack, [], length=length, n=n)
    outside = [seq for seq in observed if seq not in exact]
    stat, p, cells = sf.merged_chi_square(observed, exact) if not outside else (float("inf"), 0.0, 0)
    print(f"biased head, {length} tokens: chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p < ALPHA
