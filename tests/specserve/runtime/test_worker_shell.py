"""The worker shell's parts built from settings: here, which feature a target makes."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from specserve.api.errors import FailedPrecondition
from specserve.engine.feature_head import head_from_target, save_feature_head
from specserve.engine.feature_maker import FeatureMaker
from specserve.engine.models import load_model
from specserve.runtime.config import TargetSettings
from specserve.runtime.worker_shell import load_target_features

pytestmark = pytest.mark.unit


def test_the_target_makes_the_feature_of_the_head_its_feature_head_names(tmp_path):
    target_dir, draft_dir = tiny_models.make_tiny_pair(tmp_path / "pair", seed=2)
    target = load_model(target_dir, device="cpu", dtype="float32")
    head = head_from_target(target.model, torch.arange(target.vocab_size), fused_layers=[0, 2])
    save_feature_head(head, tmp_path / "fused", dtype=torch.float32)
    last = FeatureMaker(target.model).name

    def made(**settings) -> str:
        return load_target_features(
            TargetSettings(model=str(target_dir), host="127.0.0.1", **settings), target
        ).name

    assert made() == made(feature_head="none") == last  # unset beside a target that is not the default one
    assert (
        made(feature_head=str(tmp_path / "fused"))
        == FeatureMaker.for_head(target.model, tmp_path / "fused").name
    )
    assert made(feature_head=str(tmp_path / "fused")).startswith("fused_layers=0,2 hidden=48 fuse=")
    # A head of another target's width is refused at start-up.
    draft = load_model(draft_dir, device="cpu", dtype="float32")
    save_feature_head(head_from_target(draft.model, torch.arange(draft.vocab_size)), tmp_path / "narrow")
    with pytest.raises(FailedPrecondition, match="reads features of 32 values; this target's are 48"):
        made(feature_head=str(tmp_path / "narrow"))
