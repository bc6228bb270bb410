"""Dynamic draft length (``SpeculationParams.min_confidence``): the draft ends a round's proposal after a
token it drafted with probability below the threshold, so ``gamma`` is a cap.

* Parsing (``GenerationParams.from_pb`` then ``specserve.coordinator.requests._speculation``): the server's setting applies to the automatic
  policy with the model proposer; a fixed gamma drafts the whole gamma unless the request asks; the n-gram
  proposer has no confidence; values outside [0, 1) are refused (the servicer's bad-input table too).
* The whole system (real Redis, gRPC servers on loopback, the tiny float32 pair): greedy output is the
  target's own at every threshold, and the threshold does cut: at 0 a proposal of a fixed gamma 3 is 3
  tokens (fewer only where the tokens left cap it), at 0.99 (the tiny random draft is never that sure) every one is a single token.
  The distribution under sampling: tests/specserve/coordinator/test_rounds_distribution.py.
"""

from __future__ import annotations

import pytest
import system_fixtures as sf

from specserve.api.errors import InvalidArgument
from specserve.api.params import GenerationParams
from specserve.coordinator.requests import _speculation
from specserve.v1 import common_pb2, coordinator_pb2

MODEL, NGRAM = common_pb2.PROPOSER_KIND_MODEL, common_pb2.PROPOSER_KIND_NGRAM


def parse(server_default: float = 0.4, **fields) -> float:
    pb = coordinator_pb2.GenerateRequest(speculation=coordinator_pb2.SpeculationParams(**fields))
    params = GenerationParams.from_pb(pb)
    return _speculation(params, max_gamma=16, vocab_size=384, min_confidence=server_default).min_confidence


@pytest.mark.unit
def test_the_servers_threshold_is_the_automatic_policys_default():
    assert parse() == pytest.approx(0.4)
    assert parse(server_default=0.0) == 0.0
    assert parse(gamma=3) == 0.0, "a fixed gamma drafts the whole gamma unless the request asks"
    assert parse(gamma=3, min_confidence=0.25) == pytest.approx(0.25)
    assert parse(min_confidence=0.0) == 0.0, "a request may turn it off"
    assert parse(proposer=NGRAM) == 0.0 and parse(proposer=NGRAM, min_confidence=0.5) == 0.0


@pytest.mark.unit
@pytest.mark.parametrize("bad", [1.0, 1.5, -0.01, float("nan"), float("inf")])
def test_a_threshold_outside_zero_to_one_is_refused(bad):
    with pytest.raises(InvalidArgument, match=r"must be in \[0, 1\)"):
        parse(min_confidence=bad)


PROMPTS = [(5, 17, 42, 99, 3, 250, 7), (11, 64, 120, 9, 9, 31)]


pytestmark_async = pytest.mark.asyncio(loop_scope="module")


@pytestmark_async
@pytest.mark.parametrize("min_confidence", [0.0, 0.99])
async def test_greedy_output_is_the_targets_and_the_threshold_cuts_proposals(stack, pair, min_confidence):
    for prompt in PROMPTS:
        want = sf.reference_greedy(pair.target_dir, prompt, 16, ignore_eos=True)
        out = await sf.generate(
            stack.address,
            sf.request(prompt, max_new_tokens=16, gamma=3, ignore_eos=True, min_confidence=min_confidence),
        )
        assert out.token_ids == want
        s = out.stats
        assert s.draft_rounds > 0
        if min_confidence == 0.0:  # 3 a round, but the last rounds are capped by the tokens left
            assert s.proposed_tokens > 2.5 * s.draft_rounds, s
        else:
            assert s.proposed_tokens == s.draft_rounds, s


@pytestmark_async
async def test_the_default_request_is_exact_with_the_servers_threshold(stack, pair):
    """Automatic gamma, nothing set: the server's threshold (0.4) applies, and greedy output is the target's."""
    for prompt in PROMPTS:
        want = sf.reference_greedy(pair.target_dir, prompt, 16, ignore_eos=True)
        out = await sf.generate(stack.address, sf.request(prompt, max_new_tokens=16, ignore_eos=True))
        assert out.token_ids == want
