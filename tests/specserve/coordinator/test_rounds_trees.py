"""Draft trees end to end (opt-in source ``tree``: the draft model's chain with the n-gram lookup's continuation as
a free branch, docs/design.md "Draft trees: exact acceptance"): real Redis, real gRPC coordinator, draft and target
on 127.0.0.1, tiny float32 models from configs.

* Greedy output with trees on is the target's own greedy decoding (gamma 0), token for token.
* Coupled output with trees on is the chain's for the same seed: the target's own Gumbel-max sampling.
* The joint distribution of 3 tokens at temperature 0.7 with trees on is the target's: a 4-token vocabulary, the
  seed's chain test's setting (tests/specserve/coordinator/test_rounds_distribution.py): N = 480 seeded sessions,
  gamma 2, Pearson chi-square with cells of expected count < 5 merged, significance level 0.001; the draft's own
  joint is rejected by the same test (it has power). In a 4-token vocabulary the lookup almost always offers a
  continuation, so most rounds verify a tree with a branch (counted).
* A malformed tree sent to the target's gRPC port gets INVALID_ARGUMENT for its item, and the session goes on.

Every check also counts the rounds whose tree had a branch (``verify_tree*`` called with more nodes than levels in
the target, which runs in this process), so the tests exercise trees, not chains only.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf

import specserve.target.verifier as target_verifier
from specserve.api.params import SamplingParams, StopConditions
from specserve.core import tree_verification
from specserve.runtime.store import SessionStore
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

COUPLED = common_pb2.SAMPLING_MODE_COUPLED
OPTIMAL = common_pb2.SAMPLING_MODE_OPTIMAL
TREES = {"opt_in_sources": ["tree"], "max_batch_size": 32}
TEXTS = (
    "def add(a, b):\n    return a + b\n\ndef add",
    "for i in range(10):\n    print",
    "the quick brown the quick",
)
MAX_NEW = 32


@pytest.fixture
def branched(monkeypatch):
    """Counts the target's tree verdicts on trees with a branch (more nodes than levels), by rule."""
    counts: Counter = Counter()
    for name in ("verify_tree", "verify_tree_greedy", "verify_tree_coupled"):
        rule = getattr(target_verifier, name)

        def counted(*args, _rule=rule, _name=name, **kwargs):
            tree = args[1]
            if tree.nodes > tree.max_depth:
                counts[_name] += 1
            return _rule(*args, **kwargs)

        monkeypatch.setattr(target_verifier, name, counted)
    return counts


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tree_stack(pair, redis_server):
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=TREES) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def invariant_tree_stack(pair, redis_server):
    target = {"kernels": "auto", "invariant": True}
    async with sf.local_stack(
        pair, redis_server.url, coordinator_overrides=TREES, target_overrides=target
    ) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def _request(prompt, **kwargs):
    req = sf.request(prompt, ignore_eos=True, **kwargs)
    req.speculation.hybrid_lookup = False  # the tree source drafts every round (the lookup is its branch)
    return req


@pytest.mark.parametrize("gamma", [2, 4, None], ids=["gamma2", "gamma4", "adaptive"])
async def test_greedy_with_trees_is_the_targets_greedy_decoding(tree_stack, pair, prompts, branched, gamma):
    for prompt in prompts:
        out = await sf.generate(tree_stack.address, _request(prompt, max_new_tokens=MAX_NEW, gamma=gamma))
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
        rows = {s.name: s for s in out.stats.sources}
        assert "tree" in rows and "model" not in rows, "the tree source drafts the session's rounds"
    if gamma is not None:  # the adaptive policy may keep this pair's poor drafts at gamma 0
        assert branched["verify_tree_greedy"] > 0, "some rounds verified a tree with a branch"


async def test_greedy_with_trees_on_invariant_passes_is_the_targets(
    invariant_tree_stack, pair, prompts, branched
):
    """With invariant passes (each node's attention reads its path's keys as a chain's step would: the same
    bits), batched with each other: the target's own greedy decoding, token for token."""
    outs = await asyncio.gather(
        *(
            sf.generate(invariant_tree_stack.address, _request(p, max_new_tokens=MAX_NEW, gamma=3))
            for p in prompts
        )
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
    assert branched["verify_tree_greedy"] > 0, "some rounds verified a tree with a branch"


async def test_coupled_with_trees_is_the_chains_text(tree_stack, stack, pair, prompts, branched):
    """Same seed, trees on and off (the default stack): the same text, the target's own Gumbel-max sampling."""
    for seed, prompt in enumerate(prompts):
        kw = {
            "max_new_tokens": MAX_NEW,
            "gamma": 3,
            "seed": 100 + seed,
            "sampling_mode": COUPLED,
            "temperature": 0.7,
        }
        with_trees = await sf.generate(tree_stack.address, _request(prompt, **kw))
        chains = await sf.generate(stack.address, _request(prompt, **kw))
        assert with_trees.token_ids == chains.token_ids
        assert with_trees.token_ids == sf.reference_coupled(
            pair.target_dir, prompt, MAX_NEW, seed=100 + seed, temperature=0.7
        )
    assert branched["verify_tree_coupled"] > 0, "some rounds verified a tree with a branch"


async def test_a_malformed_tree_is_invalid_argument_and_the_session_goes_on(tree_stack, pair, redis_server):
    """Straight to the target's gRPC port: a tree with a parent that is not an earlier node, then one with more
    nodes than the server verifies, each refused for its item with INVALID_ARGUMENT; the session's next item, a
    valid tree, commits the target's greedy tokens."""
    store = SessionStore.from_url(redis_server.url)
    try:
        prompt = (5, 17, 42, 99, 3)
        stop = StopConditions(max_new_tokens=16, ignore_eos=True)
        record = await store.create("tree-malformed", prompt, SamplingParams(temperature=0.0), stop)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tree_stack.target_ports[0]}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)

            async def verify(tokens, parents):
                base = common_pb2.SessionBase(
                    session_id=record.session_id, committed_len=record.committed_len, version=record.version
                )
                proposal = common_pb2.Proposal(token_ids=tokens, parents=parents)
                request = target_pb2.VerifyRequest(
                    items=[target_pb2.VerifyItem(base=base, proposal=proposal)]
                )
                return (await stub.Verify(request, timeout=60)).results[0]

            for tokens, parents, says in (
                ((1, 2, 3), (-1, 2, 0), "parent must be -1"),
                (tuple(range(300)), (-1,) * 300, "at most 256"),
            ):
                result = await verify(tokens, parents)
                assert result.WhichOneof("outcome") == "error"
                assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert says in result.error.message
            greedy = sf.reference_greedy(pair.target_dir, prompt, 3, ignore_eos=True)
            wrong = (greedy[0] + 1) % 384
            result = await verify((wrong, greedy[0], greedy[1]), (-1, -1, 1))
            assert result.WhichOneof("outcome") == "verdict"
            assert list(result.verdict.committed_token_ids) == greedy
            assert result.verdict.accepted_count == 2
    finally:
        await store.close()


# ---- the joint of 3 tokens, in a 4-token vocabulary --------------------------------------------------------

VOCAB = 4
PROMPT = (1, 2, 3, 1)
LENGTH = 3
N = 480
ALPHA = 0.001
CONCURRENCY = 64


@pytest.fixture(scope="module")
def vocab_pair(tmp_path_factory):
    return sf.tiny_vocab_pair(tmp_path_factory, vocab_size=VOCAB)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vocab_stack(vocab_pair, redis_server):
    async with sf.local_stack(vocab_pair, redis_server.url, coordinator_overrides=TREES) as s:
        yield s


async def _joint(stack) -> Counter:
    """The 3 tokens of N seeded generations (seeds 0..N-1) at temperature 0.7, gamma 2, trees on."""
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(seed: int) -> tuple[int, ...]:
        async with sem:
            req = _request(
                PROMPT, max_new_tokens=LENGTH, seed=seed, gamma=2, sampling_mode=OPTIMAL, temperature=0.7
            )
            out = await sf.generate(stack.address, req)
            return tuple(out.token_ids[:LENGTH])

    return Counter(await asyncio.gather(*(one(seed) for seed in range(N))))


async def test_joint_of_three_tokens_with_trees_is_the_targets(vocab_stack, vocab_pair, branched):
    params = SamplingParams(temperature=0.7)
    exact = sf.exact_joint(vocab_pair.target_dir, PROMPT, params, LENGTH)
    observed = await _joint(vocab_stack)
    assert sum(observed.values()) == N
    outside = [seq for seq in observed if seq not in exact]
    assert not outside, f"sampled sequences the target gives probability 0: {outside}"
    stat, p, cells = sf.merged_chi_square(observed, exact)
    print(f"trees: chi-square {stat:.1f} on {cells} cells, p = {p:.3g}; branched trees {dict(branched)}")
    assert p > ALPHA, f"chi-square {stat:.1f} on {cells} cells, p = {p:.2e}"
    assert branched["verify_tree"] >= N // 4, f"few rounds verified a branched tree: {dict(branched)}"
    draft_exact = sf.exact_joint(vocab_pair.draft_dir, PROMPT, params, LENGTH)
    draft_like = Counter({k: round(v * N) for k, v in draft_exact.items() if k in exact})
    assert sf.merged_chi_square(draft_like, exact)[1] < ALPHA


async def test_the_same_test_rejects_a_tree_verifier_that_forgets_the_residual(
    vocab_stack, vocab_pair, monkeypatch
):
    """The tree rule with its residual step left out (a rejected sibling leaves ``p'`` as it was, so the next
    sibling and the correction are tested against ``p`` itself: the bug the residual exists to avoid), swapped into
    the target of this process: same seeds, same test at alpha = 0.001, and it fails."""
    monkeypatch.setattr(tree_verification, "residual_distribution", lambda p, q: p)
    exact = sf.exact_joint(vocab_pair.target_dir, PROMPT, SamplingParams(temperature=0.7), LENGTH)
    observed = await _joint(vocab_stack)
    outside = [seq for seq in observed if seq not in exact]
    stat, p, cells = sf.merged_chi_square(observed, exact) if not outside else (float("inf"), 0.0, 0)
    print(f"residual forgotten: chi-square {stat:.1f} on {cells} cells, p = {p:.3g}")
    assert p < ALPHA
