"""The feature head: its unrolled training pass equals drafting with it, slot by slot."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specserve.engine.feature_head import (
    FEATURE_FUSED_LAYERS,
    FeatureHead,
    FeatureHeadConfig,
    FinalNormInput,
    LayerOutputs,
    head_from_target,
    save_feature_head,
    target_features,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaForCausalLM, FeatureHead]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    target = LlamaForCausalLM(config).eval()
    head_ids = torch.arange(0, 96, 2)  # half the vocabulary
    head = head_from_target(target, head_ids).eval()
    with torch.no_grad():  # move away from the initialisation, so that every part of the head matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return target, head


def _draft_chain(head: FeatureHead, x: torch.Tensor, f: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Drafting as the draft tier does it: true slots ``1 .. m`` in one cached pass, then ``k - 1`` drafted
    slots one at a time (tokens from ``x``: teacher forcing), each fed the previous output. Returns the
    step-``k`` logits at slot ``m + k - 1``. ``x``, ``f``: slot tokens / input features, slot ``j`` at index
    ``j - 1``. Positions count from the first slot (RoPE is relative: training's start at 1)."""
    cache = DynamicCache(config=head.config)
    step = head(x[:, :m], f[:, :m], position_ids=torch.arange(m)[None], cache=cache)
    hidden = step.hidden[:, -1:]
    logits = step.logits[:, -1]
    for i in range(1, k):
        j = m + i
        step = head(x[:, j - 1 : j], hidden, position_ids=torch.tensor([[j - 1]]), cache=cache)
        hidden, logits = step.hidden, step.logits[:, -1]
    return logits


def test_unrolled_step_k_is_the_drafting_chain(pair) -> None:
    target, head = pair
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 14))
    with torch.no_grad():
        with FinalNormInput(target) as tap:
            target(ids)
        feats = target_features(tap.hidden, target.config.rms_norm_eps)
        x, f = ids[:, 1:], feats[:, :-1]
        outs = head.unrolled(x, f, 4)
        for k in range(1, 5):
            for m in range(1, 9):
                j = m + k - 1  # slot
                expected = _draft_chain(head, x, f, m, k)
                got = outs[k - 1].logits[:, j - 1]
                torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_step_one_matches_a_plain_causal_pass(pair) -> None:
    _, head = pair
    torch.manual_seed(2)
    x = torch.randint(0, 96, (2, 10))
    f = torch.randn(2, 10, 48)
    with torch.no_grad():
        plain = head(x, f, position_ids=torch.arange(10).expand(2, 10))
        unrolled = head.unrolled(x, f, 1)[0]
    torch.testing.assert_close(unrolled.logits, plain.logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(unrolled.hidden, plain.hidden, atol=2e-5, rtol=1e-5)


def test_head_logits_cover_only_its_tokens(pair) -> None:
    _, head = pair
    with torch.no_grad():
        step = head(torch.tensor([[3]]), torch.randn(1, 1, 48), position_ids=torch.tensor([[1]]))
        full = head.scatter(step.logits)
    assert torch.isinf(full[..., 1::2]).all()
    assert torch.isfinite(full[..., ::2]).all()


def test_layer_outputs_end_with_the_final_norms_input(pair) -> None:
    """The fused feature's taps: a layer's output as the model computes it; the last layer's is the input of
    the final norm (the last-layer feature), so a fused head's ``high`` state is EAGLE-1's feature."""
    target, _ = pair
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad(), LayerOutputs(target, [0, 1]) as taps, FinalNormInput(target) as tap:
        out = target(ids, output_hidden_states=True)
    stacked = taps.stacked()  # [2, 9, 2, 48]
    assert stacked.shape == (2, 9, 2, 48)
    torch.testing.assert_close(stacked[..., 0, :], out.hidden_states[1])
    torch.testing.assert_close(stacked[..., 1, :], tap.hidden)


def test_a_fused_head_starts_as_the_last_layer_feature_and_round_trips(pair, tmp_path) -> None:
    """A fresh fused head's ``fuse`` passes the last layer's feature through (so a last-layer head's weights
    start it where that head is), its config names its layers, and its weights survive save/load; a head
    config without layers cannot claim fusion."""
    target, _ = pair
    torch.manual_seed(3)
    head = head_from_target(target, torch.arange(0, 96, 2), target_model="t", fused_layers=[0, 1]).eval()
    assert head.config.feature == FEATURE_FUSED_LAYERS and head.config.fused_layers == [0, 1]
    states = torch.randn(3, 5, 2, 48)
    last = target_features(states[..., -1, :], target.config.rms_norm_eps)
    fused = head.fused(states, target.config.rms_norm_eps)
    torch.testing.assert_close(fused, last)
    with torch.no_grad():
        head.fuse.weight.add_(0.01 * torch.randn_like(head.fuse.weight))
    save_feature_head(head, tmp_path / "head", dtype=torch.float32)
    config = FeatureHeadConfig.from_json_file(str(tmp_path / "head" / "config.json"))
    assert config.fused_layers == [0, 1]
    from safetensors.torch import load_file

    torch.testing.assert_close(load_file(str(tmp_path / "head" / "model.safetensors"))["fuse.weight"], head.fuse.weight)
    with pytest.raises(ValueError, match="fused_layers"):
        FeatureHeadConfig(feature=FEATURE_FUSED_LAYERS)
    with pytest.raises(ValueError, match="feature must be"):
        FeatureHeadConfig(feature="middle_layer")
    last_only = head_from_target(target, torch.arange(0, 96, 2))
    with pytest.raises(ValueError, match="last layer"):
        last_only.fused(states, 1e-6)
