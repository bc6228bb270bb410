"""specserve.bench.head_card on a tiny target and head: its replay is the head's own one-step predictions."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from specserve.api.params import SamplingParams
from specserve.bench import head_card
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.core.tree import DraftTree
from specserve.engine.feature_head import FinalNormInput, target_features
from specserve.engine.feature_maker import FeatureMaker

pytestmark = pytest.mark.unit


@torch.no_grad()
def test_greedy_replay_at_gamma_1_is_the_heads_one_step_agreement(pair):
    target, head = pair
    prompt = [5, 9, 14, 3, 8]
    continuation = head_card.target_greedy(target, prompt, 24, eos=-1)
    got = head_card.replay_greedy(head_card._proposer(head), FeatureMaker(target), prompt, continuation, 1, "k")
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
        head_card._proposer(head),
        FeatureMaker(target),
        [5, 9, 14],
        20,
        3,
        SamplingParams(temperature=0.7, seed=4),
        -1,
        "s",
    )
    assert got["tokens"] >= 20 and got["rounds"] >= 1
    assert 0 <= got["accepted"] <= got["proposed"] <= 3 * got["rounds"]


@torch.no_grad()
def test_greedy_tree_replay_at_gamma_1_accepts_the_heads_top_k(pair):
    """Every alternative kept (threshold 0): at gamma 1 a round accepts its token iff the continuation's next
    token is among the head's 1 + 3 best there."""
    target, head = pair
    prompt = [5, 9, 14, 3, 8]
    continuation = head_card.target_greedy(target, prompt, 24, eos=-1)
    tree = TreeBudget(1 + 3, 0.0)
    got = head_card.replay_greedy_tree(head_card._proposer(head), FeatureMaker(target), prompt, continuation, 1, tree, "k")
    seq = prompt + continuation
    with FinalNormInput(target) as tap:
        target(input_ids=torch.tensor([seq]))
    feats = target_features(tap.hidden[0], target.config.rms_norm_eps)
    logits = head.unrolled(torch.tensor([seq[1:]]), feats[None, :-1], 1)[0].logits[0]  # slot j at j - 1
    accepted = drafted = 0
    n = len(prompt)
    while n < len(seq):
        if n < len(seq) - 1:
            drafted += 1
            hit = seq[n] in head.head_token_ids[logits[n - 2].topk(4).indices].tolist()
            accepted += hit
            n += 2 if hit else 1
        else:
            n += 1
    assert (got["drafted_rounds"], got["accepted"], got["per_depth"]) == (drafted, accepted, [accepted])
    assert got["nodes"] == 4 * drafted
    chain = head_card.replay_greedy_tree(head_card._proposer(head), FeatureMaker(target), prompt, continuation, 1, CHAIN, "c")
    plain = head_card.replay_greedy(head_card._proposer(head), FeatureMaker(target), prompt, continuation, 1, "p")
    assert (chain["nodes"], chain["accepted"], chain["rounds"]) == (plain["proposed"], plain["accepted"], plain["rounds"])


def test_sampled_tree_rounds_at_temperature_0_give_the_targets_greedy_text(pair):
    """The tree's verify pass (tree mask, positions) is right: greedy acceptance of real trees commits exactly
    the target's own greedy continuation."""
    target, head = pair
    prompt = [5, 9, 14, 3, 8]
    want = head_card.target_greedy(target, prompt, 20, eos=-1)
    proposer = head_card._proposer(head)
    tree = TreeBudget(3 + 5, 0.0)
    got = head_card.sampled_tree_rounds(proposer, FeatureMaker(target), prompt, 20, 3, tree, SamplingParams(temperature=0.0), -1, "g")
    assert got["token_ids"] == want and got["nodes"] > 3 * got["drafted_rounds"]  # trees, not chains
    # The greedy replay on that text drafts the same trees and accepts the same paths.
    again = head_card.replay_greedy_tree(proposer, FeatureMaker(target), prompt, want, 3, tree, "again")
    assert {k: again[k] for k in ("nodes", "accepted", "per_depth")} == {
        k: got[k] for k in ("nodes", "accepted", "per_depth")
    }
    sampled = head_card.sampled_tree_rounds(
        proposer, FeatureMaker(target), prompt, 20, 3, tree, SamplingParams(temperature=0.7, seed=4), -1, "s"
    )
    assert sampled["tokens"] >= 20 and sampled["accepted"] == sum(sampled["per_depth"]) <= sampled["nodes"]
    assert all(a >= b for a, b in itertools.pairwise(sampled["per_depth"]))  # a depth is reached through the one above


@torch.no_grad()
def test_the_tree_pass_gives_each_node_the_logits_of_its_own_path(pair):
    target, _ = pair
    seq = [5, 9, 14, 3, 8]
    tree = DraftTree((11, 12, 13, 21, 22, 31), (-1, 0, 1, -1, 0, 3))  # a chain of 3; siblings at depths 1 and 2
    got = head_card._tree_pass(target, seq, tree)  # [nodes + 1, vocab]
    for row, node in enumerate((None, *range(tree.nodes))):
        path = [] if node is None else [tree.tokens[v] for v in tree.path(node)]
        want = target(input_ids=torch.tensor([seq + path])).logits[0, -1]
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


def test_tree_pass_costs_time_every_size(pair):
    target, _ = pair
    costs = head_card.tree_pass_costs(target, context=8, max_positions=4, steps=2, warmup=1)
    assert sorted(costs["pass_over_decode"]) == ["1", "2", "3", "4"]
    assert all(r > 0 for r in costs["pass_over_decode"].values()) and costs["decode_step_ms"] > 0


def _card() -> dict:
    row = {"acceptance": 0.5, "accepted_per_round": 1.0, "proposed": 10, "rounds": 10, "feature_bytes_per_token": 1152.0}
    kind = {
        "prompts": 2,
        "greedy_tokens": 20,
        "max_new_tokens": 10,
        "greedy": {"1": row, "2": {**row, "accepted_per_round": 1.5}},
        "t0.7": {"1": {**row, "acceptance": 0.25}},
        "t0.7_prompts": 1,
        "t0.7_max_new_tokens": 8,
    }
    costs = {"target_step_ms": 10.0, "head_step_ms": 1.0, "head_over_target_step": 0.1, "context_tokens": 8, "steps": 4}
    return {
        "when": "now",
        "machine": {"threads": 2},
        "command": "python -m specserve.bench.head_card",
        "head": "/nowhere",
        "feature_row_bytes": 1152,
        "costs": costs,
        "chat": kind,
        "code": kind,
    }


def test_the_projections_follow_the_cost_model():
    proj = head_card.projections(_card())
    assert proj["rows_per_token"] == 1.0
    # one float16 row of 4096 values per token at 10,000 tokens/s
    assert proj["wire_mb_per_s"]["4096"] == pytest.approx(4096 * 2 * 10_000 / 1e6)
    # gamma 2: 2.5 tokens per round over 2 x 0.1 + 1.2 steps
    assert proj["speedup"]["chat"]["2"]["1.2"] == pytest.approx(2.5 / 1.4)


def test_the_card_renders_every_measured_row(tmp_path):
    points = [
        {"run": f"r{f}", "fraction": f, "answer_tokens": int(1000 * f), "steps": 5, "seconds": 60, "chat_top1": f / 2}
        for f in (0.25, 0.5, 1.0)
    ]
    text = head_card.render(_card(), None, points)
    assert text.count("| chat | 0 |") == 2 and text.count("| code | 0.7 |") == 1
    assert "0.100 of a target decode step" in text and "| r0.5 | fixed steps, a fresh head | 0.5 | 500 |" in text
    head_card.plot_curve(points, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_the_tree_rows_render_in_their_own_table_beside_the_chains_tau():
    card = _card()
    assert "Draft trees" not in head_card.render(card, None, [])  # a card measured without --tree-nodes
    costs = {"decode_step_ms": 10.0, "pass_over_decode": {"1": 1.0, "4": 1.3, "6": 1.5}, "context_tokens": 8,
             "steps": 4}
    tot = {"nodes": 50, "accepted": 12, "rounds": 14, "drafted_rounds": 10, "per_depth": [8, 4]}
    row = head_card._tree_row(tot, costs)
    assert row["tau"] == pytest.approx(2.2) and row["per_depth"] == [0.8, 0.4]
    assert row["verify_over_decode"] == 1.5  # 1 + 5 nodes: the 6-position pass
    for kind in ("chat", "code"):
        card[kind] = {**card[kind], "tree_greedy": {"2": row}, "tree_t0.7": {"2": row}}
    card |= {"tree": {"nodes": 8, "min_path_probability": 0.05}, "tree_costs": costs}
    text = head_card.render(card, None, [])
    assert "## Draft trees from the head's ranking" in text and "at least 0.05, at most gamma + 8 nodes" in text
    assert "| chat | 0 | 2 | 2.20 | 2.50 | 5.0 | 0.80 / 0.40 | 1.50x |" in text  # the chain's tau: 1 + 1.5
    assert "| code | 0.7 | 2 | 2.20 | - |" in text  # no chain row sampled at gamma 2


def test_a_new_rendering_keeps_the_hand_written_section_and_only_it(tmp_path):
    readme = tmp_path / "README.md"
    assert head_card.hand_written(readme) == ""
    readme.write_text("# old figures\n\n## Cost\n\nold\n\n## In the service\n\nBelow break-even today.\n")
    kept = head_card.hand_written(readme)
    assert kept == "\n## In the service\n\nBelow break-even today.\n"
    readme.write_text(head_card.render(_card(), None, []) + kept)
    assert readme.read_text().count("## In the service") == 1 and "old figures" not in readme.read_text()


def test_a_cards_json_keeps_its_curve_for_a_later_rendering(tmp_path):
    run = tmp_path / "curve-0.5"
    run.mkdir()
    history = [{"step": 5, "heldout": {"chat": {"top1_per_step": [0.3]}, "code": {"top1_per_step": [0.2]}}}]
    meta = {"fraction": 0.5, "answer_tokens": 500, "step": 5, "elapsed_s": 61.2, "history": history}
    (run / "train_meta.json").write_text(json.dumps(meta))
    points = head_card.curve_points([run])
    assert points == [{"run": "curve-0.5", "recipe": "fixed steps, a fresh head", "fraction": 0.5,
                       "answer_tokens": 500, "steps": 5, "seconds": 61, "chat_top1": 0.3, "code_top1": 0.2}]
    card = tmp_path / "card.json"
    card.write_text(json.dumps({**_card(), "curve": points}))
    shutil.rmtree(run)  # the run's directory is gone; the card's JSON still has its point
    assert head_card.curve_points([card]) == points


def test_a_curve_at_fixed_epochs_names_its_recipe_beside_the_fixed_steps_one(tmp_path):
    run = tmp_path / "epochs-0.5"
    run.mkdir()
    history = [{"step": 9, "heldout": {"chat": {"top1_per_step": [0.4]}, "code": {"top1_per_step": [0.5]}}}]
    args = {"epochs": 1.0, "init": "/x/specserve-smollm2-head", "feature": "fused", "reg_weight": 0.0}
    meta = {"fraction": 0.5, "answer_tokens": 900, "step": 9, "elapsed_s": 30.0, "history": history, "args": args}
    (run / "train_meta.json").write_text(json.dumps(meta))
    (point,) = head_card.curve_points([run])
    assert point["recipe"] == "1 epoch, from specserve-smollm2-head, fused layers, no regression"
    old = {"run": "old", "fraction": 1.0, "answer_tokens": 800, "steps": 400, "seconds": 9, "chat_top1": 0.4}
    text = head_card.render(_card(), None, [old, point])
    assert "| old | fixed steps, a fresh head | 1 | 800 | 400 |" in text
    assert "| epochs-0.5 | 1 epoch, from specserve-smollm2-head, fused layers, no regression | 0.5 | 900 | 9 |" in text
    head_card.plot_curve([old, point], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_the_training_section_says_what_data_and_start_the_head_had():
    args = {"shards": None, "code_repeat": 4, "init": "/tmp/earlier-head", "batch_tokens": 4096, "unroll": 4,
            "lr": 0.001}
    meta = {"answer_tokens": 1_000_000, "records": 4544, "step": 1000, "elapsed_s": 2880.0, "args": args}
    text = head_card.render(_card(), meta, [])
    assert "1,000,000 answer tokens of 4,544 target answers (`data/smollm2-answers/`, every shard, code answers" \
        " sampled 4x as often), 1000 steps of 4096 tokens in 48 minutes" in text
    assert "starting from the head in `/tmp/earlier-head`." in text
    shipped = head_card.render(_card(), {**meta, "args": {**args, "shards": 16, "code_repeat": 1, "init": None}}, [])
    assert "the first 16 shards of each phase), 1000 steps" in shipped and "starting from" not in shipped


def test_rendering_from_a_cards_json_writes_the_curve_into_it(tmp_path):
    """``--from-json card.json --json card.json --curve RUN``: nothing measured, the card rendered, and the
    curve's points kept in the JSON for the next rendering."""
    from specserve.bench.options import HeadCardOptions

    run = tmp_path / "curve-1.0"
    run.mkdir()
    history = [{"step": 9, "heldout": {"chat": {"top1_per_step": [0.45]}, "code": {"top1_per_step": [0.4]}}}]
    meta = {"fraction": 1.0, "answer_tokens": 900, "step": 9, "elapsed_s": 30.0, "history": history}
    (run / "train_meta.json").write_text(json.dumps(meta))
    card = tmp_path / "card.json"
    card.write_text(json.dumps({**_card(), "head": str(tmp_path / "no-head")}))
    readme = tmp_path / "README.md"
    opts = HeadCardOptions(from_json=card, json=card, readme=readme, curve=[run])
    assert head_card.main(opts) == 0
    assert [p["run"] for p in json.loads(card.read_text())["curve"]] == ["curve-1.0"]
    assert "| curve-1.0 | fixed steps, a fresh head | 1 | 900 | 9 | 30 | 0.450 | 0.400 |" in readme.read_text()
    assert (tmp_path / "data_size.png").stat().st_size > 1000


@torch.no_grad()
def test_coupled_tree_rounds_emit_the_target_alones_coupled_text_whatever_the_tree(pair):
    """In the coupled mode the card's sampled tree rounds verify with the coupled rule: the text is the
    target alone's Gumbel-max sampling for the seed, the same with a chain and with a tree."""
    target, head = pair
    params = SamplingParams(temperature=0.8, seed=7, sampling_mode="coupled")
    prompt = [5, 9, 14]
    runs = [
        head_card.sampled_tree_rounds(
            head_card._proposer(head), FeatureMaker(target), prompt, 16, 3, tree, params, -1, f"c{i}"
        )
        for i, tree in enumerate((CHAIN, TreeBudget(8, 0.0)))
    ]
    assert runs[1]["nodes"] > 3 * runs[1]["drafted_rounds"]  # more than chains of 3: the tree had alternatives
    alone = coupled_text(target, prompt, 16, params)
    assert runs[0]["token_ids"][:16] == runs[1]["token_ids"][:16] == alone


def coupled_text(target, prompt, n, params):
    """The target alone's coupled text: ``argmax(log p + G(seed, position))`` token by token."""
    from specserve.core.rng import gumbel_noise
    from specserve.core.sampling import gumbel_argmax, logits_to_probs

    seq = list(prompt)
    for _ in range(n):
        p = logits_to_probs(target(input_ids=torch.tensor([seq])).logits[0, -1:].float(), params, None)
        seq.append(int(gumbel_argmax(p, gumbel_noise([params.seed], [len(seq)], p.shape[-1]))[0]))
    return seq[len(prompt) :]


@torch.no_grad()
def test_coupled_lists_collects_one_pair_per_token_of_the_target_alones_coupled_text(pair):
    """benchmarks.coupled_lists.collect_pairs: one (p, q) per token, each a distribution, p the target's
    processed row at that prefix, along the target alone's coupled text."""
    from benchmarks.coupled_lists import collect_pairs
    from specserve.core.sampling import logits_to_probs

    target, head = pair
    params = SamplingParams(temperature=0.8, seed=7, sampling_mode="coupled")
    prompt = [5, 9, 14]
    pairs = collect_pairs(head_card._proposer(head), FeatureMaker(target), prompt, 6, params, -1, "k")
    text = coupled_text(target, prompt, 6, params)
    assert len(pairs) == 6
    for i, (p, q) in enumerate(pairs):
        assert float(p.sum()) == pytest.approx(1.0, abs=1e-4) and float(q.sum()) == pytest.approx(1.0, abs=1e-4)
        want = logits_to_probs(target(input_ids=torch.tensor([prompt + text[:i]])).logits[0, -1:].float(), params, None)
        assert torch.allclose(p, want[0].float(), atol=1e-5)
