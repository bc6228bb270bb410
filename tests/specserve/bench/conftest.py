"""Fixtures of the bench tests."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from specserve.engine.feature_head import head_from_target
from specserve.engine.models import load_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a feature head on it, moved well away from its initialisation (the head cards' tests)."""
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("head_card"), seed=9)
    target = load_model(target_dir, device="cpu", dtype="float32").model
    torch.manual_seed(1)
    head = head_from_target(target, torch.arange(target.config.vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return target, head.eval()
