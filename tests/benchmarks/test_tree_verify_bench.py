"""benchmarks.tree_verify: its options refuse what no run can do, and one setting on a tiny model times every
path and finds the two tree passes' logits equal."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from benchmarks.options import TreeVerifyOptions
from benchmarks.tree_verify import PATHS, bushy, one_setting, render
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit


def test_the_options_refuse_empty_trees_and_no_rounds_by_name():
    with pytest.raises(ValueError, match="--nodes"):
        TreeVerifyOptions(nodes=[0])
    with pytest.raises(ValueError, match="--pairs"):
        TreeVerifyOptions(pairs=0)


def test_a_bushy_tree_has_two_children_per_node():
    assert bushy(6) == (-1, -1, 0, 0, 1, 1)


def test_one_setting_times_every_path_and_the_tree_passes_agree(tmp_path):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    model = load_model(target_dir, device="cpu", dtype="float32").model
    row = one_setting(model, context=12, nodes=5, pairs=2, gen=torch.Generator().manual_seed(0))
    assert set(row["ms"]) == set(PATHS) and all(ms > 0 for ms in row["ms"].values())
    assert row["over_decode"]["decode"] == 1.0
    assert row["logits_max_abs_difference"] < 1e-5
    data = {"command": "python -m benchmarks tree-verify", "date_utc": "2026-12-07 00:00", "machine": "x86_64",
            "target": "t", "settings": {"threads": 2, "pairs": 2}, "results": {"onednn": {"12": {"5": row}}}}
    text = render(data)
    assert text.count("\n| ") == 3 and "| onednn | 12 | 5 |" in text
