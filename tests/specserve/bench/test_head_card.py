"""specserve.bench.head_card on a tiny target and head: its replay is the head's own one-step predictions."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from specserve.api.params import SamplingParams
from specserve.bench import head_card
from specserve.engine.feature_head import FinalNormInput, head_from_target, target_features
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("head_card"), seed=9)
    target = load_model(target_dir, device="cpu", dtype="float32").model
    torch.manual_seed(1)
    head = head_from_target(target, torch.arange(target.config.vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return target, head.eval()


@torch.no_grad()
def test_greedy_replay_at_gamma_1_is_the_heads_one_step_agreement(pair):
    target, head = pair
    prompt = [5, 9, 14, 3, 8]
    continuation = head_card.target_greedy(target, prompt, 24, eos=-1)
    got = head_card.replay_greedy(head_card._proposer(head), target, prompt, continuation, 1, "k")
    # By hand: round r drafts at the end of the committed text; slot j's step-1 output predicts token j + 1.
    seq = prompt + continuation
    with FinalNormInput(target) as tap:
        target(input_ids=torch.tensor([seq]))
    feats = target_features(tap.hidden[0], target.config.rms_norm_eps)
    logits = head.unrolled(torch.tensor([seq[1:]]), feats[None, :-1], 1)[0].logits[0]  # slot j at j - 1
    accepted = proposed = last = 0
    n = len(prompt)
    while n < len(seq):
        if n < len(seq) - 1:
            proposed += 1
            last = n
            hit = int(head.head_token_ids[logits[n - 2].argmax()]) == seq[n]
            accepted += hit
            n += 2 if hit else 1
        else:
            n += 1
    assert (got["proposed"], got["accepted"]) == (proposed, accepted)
    assert got["rows"] == last - 1  # each position's feature relayed once, up to the last drafted round


def test_sampled_rounds_commit_what_they_count(pair):
    target, head = pair
    got = head_card.sampled_rounds(
        head_card._proposer(head), target, [5, 9, 14], 20, 3, SamplingParams(temperature=0.7, seed=4), -1, "s"
    )
    assert got["tokens"] >= 20 and got["rounds"] >= 1
    assert 0 <= got["accepted"] <= got["proposed"] <= 3 * got["rounds"]
