"""benchmarks.trees: head trees against head chains through two coordinators on one stack's workers, on the tiny
pair and a tiny feature head; both arms' greedy outputs are HF generate()'s."""

from __future__ import annotations

import json

import pytest
import system_fixtures as sf

from benchmarks import trees
from benchmarks.cli import main
from benchmarks.options import TreesOptions
from specserve.bench import gate


@pytest.mark.system
def test_both_arms_run_on_the_tiny_pair_and_match_hf(tmp_path_factory, tmp_path):
    pair = sf.tiny_pair(tmp_path_factory)
    opts = TreesOptions(target=str(pair.target_dir), kinds=["chat"], prompts=1)
    prompt = gate._prompts(opts, pair.tokenizer)["chat"][0][1]
    head = sf.tiny_head(pair, tmp_path_factory, [prompt])  # knows the prompt's continuation: its drafts land
    argv = [
        "trees", "--target", str(pair.target_dir), "--draft", str(pair.draft_dir), "--head", str(head),
        "--kinds", "chat", "--prompts", "1", "--max-new-tokens", "8", "--repeats", "2", "--out", str(tmp_path),
        # The tiny pair's costs make the policy run the target alone: a fixed gamma, and every alternative kept.
        "--gamma", "3", "--setting", "coordinator.draft_tree_min_path_probability=0",
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "trees.json").read_text())
    assert {g["mode"] for g in data["generations"]} == set(trees.ORDER)
    assert len(data["generations"]) == 2 * len(trees.ORDER) and all(
        g["tokens"] == 8 for g in data["generations"]
    )
    modes = data["summary"]["table"]["chat"]["modes"]
    for arm in trees.ARMS:
        assert data["summary"]["greedy_identity"][arm] == {"identical": 2, "of": 2}
        assert data["summary"]["proposers"][arm] == ["feature"]
        assert (
            modes[arm]["draft_rounds"] > 0 and modes[arm]["tau"] > 1.0
        )  # the head drafted, and was accepted
        assert modes[arm]["projection"] is None  # the tiny head has no card: no measured cost ratio
    assert modes[trees.CHAINS]["nodes_per_round"] <= 3 == modes[trees.CHAINS]["gamma_per_round"]  # a chain
    assert modes[trees.TREES]["nodes_per_round"] > 3 == modes[trees.TREES]["gamma_per_round"]  # a tree
    assert modes[trees.TREES]["draft_steps_per_round"] == 3  # its chain's steps, not its nodes
    assert "trees_over_chains" in data["summary"]["table"]["chat"]
    # A fixed gamma keeps no hybrid lookup: no branches; each generation prefilled its own prompt.
    assert modes[trees.TREES]["branch_nodes"] == 0 == modes[trees.CHAINS]["branch_nodes"]
    served = [g for g in data["generations"] if g["mode"] in trees.ARMS]
    assert served and all(g["cached_tokens"] == 0 for g in served)
    text = (tmp_path / "trees.md").read_text()
    assert "| trees over chains |" in text and "identical to HF generate(), token by token" in text
    assert data["cpu_kind"]["cpu"] in text
