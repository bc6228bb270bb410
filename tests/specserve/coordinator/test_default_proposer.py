"""coordinator.coordinator.default_proposer: what a request that names no proposer drafts with."""

from __future__ import annotations

import pytest

from specserve.coordinator.coordinator import default_proposer
from specserve.runtime.config import CoordinatorSettings
from specserve.v1 import common_pb2

pytestmark = pytest.mark.unit

MODEL, FEATURE = common_pb2.PROPOSER_KIND_MODEL, common_pb2.PROPOSER_KIND_FEATURE


def test_the_head_is_the_default_where_every_draft_serves_one_else_the_token_draft():
    setting = CoordinatorSettings.model_fields["default_proposer"].default
    assert setting == "auto"
    assert default_proposer(setting, True) == FEATURE and default_proposer(setting, False) == MODEL


def test_model_keeps_the_token_draft_even_where_a_head_is_served():
    assert default_proposer("model", True) == MODEL and default_proposer("model", False) == MODEL


def test_auto_takes_the_head_where_every_draft_serves_one():
    assert default_proposer("auto", True) == FEATURE
    assert default_proposer("auto", False) == MODEL


def test_feature_without_a_head_is_refused_at_start():
    assert default_proposer("feature", True) == FEATURE
    with pytest.raises(ValueError, match="serve no feature head"):
        default_proposer("feature", False)
