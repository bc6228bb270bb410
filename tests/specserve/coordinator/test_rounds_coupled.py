"""The coupled sampling mode end to end: real Redis, real gRPC coordinator, draft and target, tiny float32 models.

In the coupled mode a sampled request's output is a function of the target, the
prompt, the sampling settings and the seed alone. Every test compares the
streamed tokens with :func:`system_fixtures.reference_coupled`: the target's own
Gumbel-max sampling, ``argmax(log p_j + G_j)``, computed here from Hugging Face
logits and processors with the same noise function. So the output is checked to
be token-identical

* for gamma 0 (the target alone), 1, 3, 8 and adaptive, with the model and the
  n-gram proposers, each request alone;
* for a request batched with 7 other sessions of every kind (greedy, optimal,
  coupled with other seeds; other gammas and proposers);
* when the draft's noise differs from the target's (a perturbed seed on the wire
  to the draft): only acceptance drops;
* when the draft tier is down, from the start or from mid-generation.

(A target replica killed mid-generation: ``tests/reliability/test_kill.py``.)
Every stream is also checked to be its Redis log.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from prometheus_client import REGISTRY
from waiting import wait_until

from specserve.runtime.store import SessionStore
from specserve.v1 import common_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

COUPLED = common_pb2.SAMPLING_MODE_COUPLED
OPTIMAL = common_pb2.SAMPLING_MODE_OPTIMAL
MODEL = common_pb2.PROPOSER_KIND_MODEL
NGRAM = common_pb2.PROPOSER_KIND_NGRAM
TEXTS = ("def add(a, b):\n", "for i in range(10):\n    print", "the quick brown")
MAX_NEW = 32
#: Sampling settings of the sweep: plain temperature 1, and every processor at once.
SETTINGS = {
    "t1": {"temperature": 1.0},
    "all-processors": {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.2},
}


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()


def coupled_request(prompt, seed, *, gamma, proposer=MODEL, max_new_tokens=MAX_NEW, **sampling):
    sampling = sampling or SETTINGS["t1"]
    return sf.request(
        prompt,
        max_new_tokens=max_new_tokens,
        seed=seed,
        gamma=gamma,
        proposer=proposer,
        ignore_eos=True,
        sampling_mode=COUPLED,
        **sampling,
    )


async def assert_stream_is_log(store: SessionStore, out: sf.Generated) -> None:
    record = await store.load(out.stats.session_id)
    assert list(record.generated_token_ids) == out.token_ids and record.finished


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
async def test_the_same_seed_gives_the_same_text_for_every_gamma_and_proposer(
    stack, store, pair, prompts, setting
):
    """Each request alone (one at a time): gamma 0, 1, 3, 8 and adaptive, model and n-gram proposers,
    two prompts: all equal the reference, gamma 0 included (the target's own Gumbel-max sampling)."""
    sampling = SETTINGS[setting]
    accepted = 0
    for index, prompt in enumerate(prompts[:2]):
        seed = 1000 + index
        want = sf.reference_coupled(pair.target_dir, prompt, MAX_NEW, seed=seed, **sampling)
        for proposer in (MODEL, NGRAM):
            for gamma in (0, 1, 3, 8, None):
                out = await sf.generate(
                    stack.address, coupled_request(prompt, seed, gamma=gamma, proposer=proposer, **sampling)
                )
                assert out.token_ids == want, (setting, index, proposer, gamma)
                assert out.stats.seed == seed
                await assert_stream_is_log(store, out)
                assert (await store.load(out.stats.session_id)).sampling.sampling_mode == "coupled"
                if gamma:
                    assert out.stats.proposed_tokens > 0 or proposer == NGRAM
                accepted += out.stats.accepted_tokens
    assert accepted > 0, "no draft token was ever accepted: the accept path was not exercised"


async def test_batched_with_seven_other_sessions(stack, store, pair, prompts):
    """The request runs alongside 7 other sessions (greedy, one of them in the coupled mode, optimal
    and coupled with other seeds, other gammas and proposers, other prompts), so its items share
    Verify batches with them: it equals the reference, as do the other coupled sessions, and the
    greedy ones equal generate()."""
    seed = 4242
    want = sf.reference_coupled(pair.target_dir, prompts[0], MAX_NEW, seed=seed)
    others = [
        (sf.request(prompts[1], max_new_tokens=MAX_NEW, gamma=2, ignore_eos=True), "greedy", prompts[1]),
        (  # greedy in the coupled mode: no noise, the target's argmax
            sf.request(
                prompts[2],
                max_new_tokens=MAX_NEW,
                gamma=4,
                proposer=NGRAM,
                ignore_eos=True,
                sampling_mode=COUPLED,
            ),
            "greedy",
            prompts[2],
        ),
        (
            sf.request(prompts[0], max_new_tokens=MAX_NEW, temperature=1.0, seed=5, gamma=3, ignore_eos=True),
            "optimal",
            None,
        ),
        (
            sf.request(
                prompts[1],
                max_new_tokens=MAX_NEW,
                temperature=0.9,
                seed=6,
                ignore_eos=True,
                sampling_mode=OPTIMAL,
            ),
            "optimal",
            None,
        ),
        (coupled_request(prompts[1], 7, gamma=1), "coupled", (prompts[1], 7)),
        (coupled_request(prompts[2], 8, gamma=None), "coupled", (prompts[2], 8)),
        (coupled_request(prompts[0], seed + 1, gamma=8, proposer=NGRAM), "coupled", (prompts[0], seed + 1)),
    ]
    batches_before = _verify_batches()
    outs = await asyncio.gather(
        sf.generate(stack.address, coupled_request(prompts[0], seed, gamma=3)),
        *(sf.generate(stack.address, req) for req, _, _ in others),
    )
    calls, items = (after - before for after, before in zip(_verify_batches(), batches_before, strict=True))
    assert items > calls, f"no Verify call carried more than one item ({items} items in {calls} calls)"
    assert outs[0].token_ids == want
    for out, (_, kind, ref) in zip(outs[1:], others, strict=True):
        await assert_stream_is_log(store, out)
        if kind == "greedy":
            assert out.token_ids == sf.reference_greedy(pair.target_dir, ref, MAX_NEW, ignore_eos=True)
        elif kind == "coupled":
            assert out.token_ids == sf.reference_coupled(pair.target_dir, ref[0], MAX_NEW, seed=ref[1])
    await assert_stream_is_log(store, outs[0])


def _verify_batches() -> tuple[float, float]:
    """(Verify calls, items verified) so far, from the coordinator's batch-size histogram."""
    count = REGISTRY.get_sample_value("specserve_coordinator_verify_batch_size_count") or 0.0
    total = REGISTRY.get_sample_value("specserve_coordinator_verify_batch_size_sum") or 0.0
    return count, total


class PerturbedNoiseStub:
    """Wraps a draft stub: every Propose carries another seed, so the draft's Gumbel noise differs from
    the target's (the target reads the seed from Redis, untouched)."""

    def __init__(self, stub, offset: int = 1_000_003) -> None:
        self._stub = stub
        self._offset = offset
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def _perturb(self, request, into=None):
        perturbed = into if into is not None else type(request)()
        perturbed.CopyFrom(request)
        perturbed.seed = (request.seed + self._offset) % 2**64
        perturbed.sampling.seed = perturbed.seed
        return perturbed

    def Propose(self, request, **kwargs):
        self.calls += 1
        return self._stub.Propose(self._perturb(request), **kwargs)

    def ProposeBatch(self, request, **kwargs):  # concurrent sessions are drafted in one call
        batch = type(request)()
        for item in request.items:
            self._perturb(item, into=batch.items.add())
        self.calls += 1
        return self._stub.ProposeBatch(batch, **kwargs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def self_draft_stack(pair, redis_server):
    """The target as its own draft: with the same noise every proposal is accepted (up to float32)."""
    same = sf.TinyPair(pair.target_dir, pair.target_dir)
    async with sf.local_stack(same, redis_server.url) as s:
        yield s


@contextlib.contextmanager
def perturbed_draft_noise(stack):
    clients = stack.coordinator.coordinator.pool.draft_clients
    originals = {ep: client.stub for ep, client in clients.items()}
    wrappers = {ep: PerturbedNoiseStub(stub) for ep, stub in originals.items()}
    for ep, client in clients.items():
        client.stub = wrappers[ep]
    try:
        yield wrappers
    finally:
        for ep, client in clients.items():
            client.stub = originals[ep]


@pytest.mark.parametrize("which", ["tiny-draft", "self-draft"])
async def test_a_draft_with_other_noise_changes_acceptance_not_output(
    stack, self_draft_stack, store, pair, prompts, which
):
    """Three requests with gamma 3, first with the draft's noise as it should be, then with every
    Propose carrying a perturbed seed: the same tokens (the reference's) both times, fewer accepted.
    With the target as its own draft the shared noise accepts nearly every proposal and the other
    noise almost none (measured: 108 of 108 against 0); with the tiny draft 33 of 323 against 1."""
    s = stack if which == "tiny-draft" else self_draft_stack
    requests = [coupled_request(p, 900 + i, gamma=3, max_new_tokens=48) for i, p in enumerate(prompts)]
    plain = await asyncio.gather(*(sf.generate(s.address, r) for r in requests))
    with perturbed_draft_noise(s) as wrappers:
        perturbed = await asyncio.gather(*(sf.generate(s.address, r) for r in requests))
    assert sum(w.calls for w in wrappers.values()) > 0
    for i, (a, b) in enumerate(zip(plain, perturbed, strict=True)):
        assert (
            a.token_ids == b.token_ids == sf.reference_coupled(pair.target_dir, prompts[i], 48, seed=900 + i)
        )
        await assert_stream_is_log(store, b)
    accepted_plain = sum(o.stats.accepted_tokens for o in plain)
    accepted_perturbed = sum(o.stats.accepted_tokens for o in perturbed)
    proposed = sum(o.stats.proposed_tokens for o in plain)
    print(
        f"{which}: accepted {accepted_plain} (shared noise) vs {accepted_perturbed} (other noise) of {proposed}"
    )
    assert accepted_perturbed < accepted_plain, (accepted_plain, accepted_perturbed, proposed)
    if which == "self-draft":
        assert accepted_plain > 0.9 * proposed and accepted_perturbed < 0.5 * accepted_plain


async def _stream(address: str, request, tokens: list[int]):
    """A Generate call that appends each token to ``tokens`` as it arrives; returns the closing stats."""
    async with grpc.aio.insecure_channel(address) as channel:
        stats = None
        async for reply in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
            request, timeout=120
        ):
            if reply.WhichOneof("event") == "chunk":
                tokens.extend(reply.chunk.token_ids)
            else:
                stats = reply.stats
        return stats


async def test_the_draft_tier_down_changes_nothing(pair, redis_server, store, prompts):
    """The draft server stops while two coupled sessions stream (gamma 4): they finish at gamma 0 with
    the reference's tokens; a session started afterwards makes no proposal and equals it too."""
    max_new = 96
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides={"draft_timeout_s": 2.0}) as s:
        streams = [
            ([], coupled_request(prompts[i], 70 + i, gamma=4, max_new_tokens=max_new)) for i in range(2)
        ]
        tasks = [asyncio.create_task(_stream(s.address, req, tokens)) for tokens, req in streams]
        await wait_until(lambda: all(len(t) >= 3 for t, _ in streams), timeout_s=60, what="3 tokens each")
        await s.stop_draft()
        at_stop = [len(tokens) for tokens, _ in streams]
        stats = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
        assert any(n < max_new for n in at_stop), "every session had finished before the draft stopped"
        for i, ((tokens, _), st) in enumerate(zip(streams, stats, strict=True)):
            assert tokens == sf.reference_coupled(pair.target_dir, prompts[i], max_new, seed=70 + i)
            assert st.proposed_tokens > 0  # the draft did serve the first rounds
        after = await sf.generate(s.address, coupled_request(prompts[2], 72, gamma=4))
        assert after.stats.proposed_tokens == 0
        assert after.token_ids == sf.reference_coupled(pair.target_dir, prompts[2], MAX_NEW, seed=72)
        await assert_stream_is_log(store, after)
