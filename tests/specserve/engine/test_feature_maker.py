"""FeatureMaker: the target's side of the feature head, the last layer's feature or a fused head's, named."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from specserve.api.errors import FailedPrecondition
from specserve.engine.feature_head import (
    FeatureHeadConfig,
    FinalNormInput,
    LayerOutputs,
    head_from_target,
    load_feature_head,
    save_feature_head,
)
from specserve.engine.feature_maker import FeatureMaker, features_of
from specserve.engine.kvcache import SessionCache
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit

LAYERS = [0, 1, 2]  # the tiny target's three layers


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("maker"), seed=4)
    return target_dir


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, device="cpu", dtype="float32").model


def _save_head(target, target_dir, out, *, fused_layers=None, seed=0):
    """A head for ``target`` saved to ``out`` (float32), its fuse moved well away from the pass-through."""
    torch.manual_seed(seed)
    head = head_from_target(
        target,
        torch.arange(target.config.vocab_size),
        target_model=str(target_dir),
        fused_layers=fused_layers,
    )
    if head.fuse is not None:
        with torch.no_grad():
            head.fuse.weight.add_(0.3 * torch.randn_like(head.fuse.weight))
    save_feature_head(head.eval(), out, dtype=torch.float32)
    return out


def _config(head_dir, **changes):
    config = FeatureHeadConfig.from_json_file(str(head_dir / "config.json"))
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def fused_dir(target, target_dir, tmp_path_factory):
    return _save_head(target, target_dir, tmp_path_factory.mktemp("fused"), fused_layers=LAYERS)


IDS = torch.tensor([[5, 17, 33, 2, 91, 14, 40], [8, 9, 8, 9, 8, 9, 8]])  # [2, 7]


@torch.no_grad()
def test_the_last_layer_maker_makes_todays_features_bit_for_bit(target, target_dir, tmp_path):
    maker = FeatureMaker(target)
    with maker.tap() as tap:
        target(input_ids=IDS)
    with FinalNormInput(target) as plain:
        target(input_ids=IDS)
    for b in range(2):
        assert torch.equal(tap.rows(b, 5), features_of(target, plain.hidden[b, :5]))
    # A last-layer head names the same feature as the target that makes it, so the pair may start.
    head_dir = _save_head(target, target_dir, tmp_path / "last")
    assert (
        FeatureMaker.for_head(target, head_dir).name == maker.name == load_feature_head(head_dir).feature_name
    )
    assert maker.layers == () and maker.fuse is None


@torch.no_grad()
def test_the_fused_maker_is_the_heads_own_fusion_of_a_plain_pass(target, fused_dir):
    maker = FeatureMaker.for_head(target, fused_dir)
    head = load_feature_head(fused_dir)
    assert maker.layers == tuple(LAYERS)
    with maker.tap() as tap:
        target(input_ids=IDS)
    with LayerOutputs(target, LAYERS) as plain:
        target(input_ids=IDS)
    expected = head.fused(plain.stacked(), maker.eps)  # [2, 7, hidden]
    for b in range(2):
        got = tap.rows(b, 6)
        assert got.shape == (6, target.config.hidden_size) and got.dtype == torch.float32
        # Two code paths of the same float32 math: equal to rounding (bit-equal only where both run one kernel).
        torch.testing.assert_close(got, expected[b, :6], rtol=1e-5, atol=1e-5)
    with FinalNormInput(target) as last:
        target(input_ids=IDS)
    assert not torch.allclose(
        tap.rows(0, 7), features_of(target, last.hidden[0]), atol=1e-2
    )  # another feature
    assert maker.name == head.feature_name and maker.name.startswith("fused_layers=0,1,2 hidden=48 fuse=")


def test_another_heads_projection_is_another_feature(target, target_dir, fused_dir, tmp_path):
    other = _save_head(target, target_dir, tmp_path / "other", fused_layers=LAYERS, seed=1)
    assert FeatureMaker.for_head(target, other).name != FeatureMaker.for_head(target, fused_dir).name
    assert FeatureMaker.for_head(target, other).name != FeatureMaker(target).name


def test_a_head_that_does_not_fit_the_target_is_refused(target, target_dir, fused_dir, tmp_path):
    with pytest.raises(FailedPrecondition, match=r"fuses layers \[0, 1, 5\]; this target has layers 0\.\.2"):
        FeatureMaker(target, _config(fused_dir, fused_layers=[0, 1, 5]), torch.zeros(48, 3 * 48))
    with pytest.raises(FailedPrecondition, match="reads features of 64 values; this target's are 48"):
        FeatureMaker(target, _config(fused_dir, hidden_size=64), torch.zeros(64, 3 * 64))
    with pytest.raises(FailedPrecondition, match="not a feature head directory"):
        FeatureMaker.for_head(target, tmp_path)


@torch.no_grad()
def test_a_session_cache_keeps_the_fused_features_of_what_it_feeds(target, fused_dir):
    """A tracking cache's own passes (a prefill, then a branch) make their features with its maker."""
    maker = FeatureMaker.for_head(target, fused_dir)
    cache = SessionCache(target, "s", feature_maker=maker)
    cache.track_features()
    tokens = IDS[0].tolist()
    cache.extend(tokens[:4])
    cache.extend(tokens[4:])
    with maker.tap() as tap:
        target(input_ids=IDS[:1])
    torch.testing.assert_close(cache.feature_rows(0, 7).float(), tap.rows(0, 7), atol=2e-3, rtol=2e-3)
