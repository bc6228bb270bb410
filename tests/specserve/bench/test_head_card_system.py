"""specserve.bench.head_card's whole run with --tree-nodes on a tiny target and head: the tree rows of every
gamma, their verify costs, and the card's tree table."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.bench import head_card
from specserve.bench.options import HeadCardOptions
from specserve.engine.feature_head import save_feature_head

pytestmark = pytest.mark.system  # the card names the machine's processor (uname)


def test_a_card_with_tree_nodes_measures_the_tree_rows_of_every_gamma(pair, tmp_path):
    target, head = pair
    save_feature_head(head, tmp_path / "head", dtype=torch.float32)
    opts = HeadCardOptions(
        target=str(target.name_or_path), head=str(tmp_path / "head"), prompts=1, max_new_tokens=8, sampled_prompts=1,
        sampled_tokens=6, context=8, cost_steps=2, gammas=[1, 3], sampled_gammas=[2], tree_nodes=3,
    )  # fmt: skip
    card = head_card.run(opts)
    assert card["tree"] == {"nodes": 3, "min_path_probability": 0.05, "expanded": True}
    assert sorted(card["tree_costs"]["pass_over_decode"], key=int) == [str(k) for k in range(1, 3 + 3 + 2)]
    for kind in ("chat", "code"):
        assert list(card[kind]["tree_greedy"]) == [1, 3] and list(card[kind]["tree_t0.7"]) == [2]
        for gamma, row in card[kind]["tree_greedy"].items():
            assert len(row["per_depth"]) == gamma and row["nodes_per_round"] <= gamma + 3
            assert "verify_over_decode" in row
    assert "## Draft trees from the head's ranking" in head_card.render(
        json.loads(json.dumps(card)), None, []
    )
