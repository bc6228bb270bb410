"""The feature head's model card figures: acceptance per gamma, its cost, and its bytes on the wire.

Run (the figures in ``specserve/models/specserve-smollm2-head/README.md`` come from this)::

    specserve bench head-card --json specserve/models/specserve-smollm2-head/card.json \
        --readme specserve/models/specserve-smollm2-head/README.md --curve RUN_DIR [RUN_DIR ...]

``--readme`` renders the card from the figures, the head's ``training_meta.json``
and the data-size curve: the training runs ``--curve`` names (each a
``scripts/train_feature_head.py train --fraction F`` run directory, or a card's
JSON, which keeps its curve's points), their held-out acceptance against their
answer tokens, drawn as ``data_size.png``.

In float32 on the CPU, batch 1, on the held-out prompts of
:mod:`specserve.prompts.chat` (subjects never seen in training), the head
drafting through the draft tier's own code (:class:`specserve.draft.feature_proposer.FeatureProposer`)
from the target's features, as the service relays them:

* **Greedy acceptance per gamma** (temperature 0): each round is replayed on the
  target's greedy continuation (the committed text at T = 0). The proposer gets
  the committed tokens and the features of the positions the last round
  committed; the accepted prefix is the part of its proposal equal to the
  continuation. ``acceptance`` is accepted / proposed draft tokens,
  ``accepted_per_round`` the mean accepted draft tokens per drafted round.
* **Acceptance at temperature 0.7**: real speculative sampling with
  specserve's sampler and verifier (``verify_batch``), the target's features of
  each round's committed positions taken from its own verify pass.
* **Cost**: the target's decode step over the head's draft step (both after a
  ``--context``-token context, interleaved medians), and the bytes the features
  add per committed token on the wire (float16 rows), measured over the greedy
  runs: rows relayed / tokens committed, times the row's bytes. A fused head's
  feature is projected on the target (:class:`~specserve.engine.feature_maker.FeatureMaker`),
  so its rows are ``hidden`` values too; the card also gives what shipping the
  layers' states unprojected would cost.
* **Draft trees** (``--tree-nodes N``, the card's own fixed ``--tree-min-path-probability``): the same greedy
  replay and sampled rounds with the head's tree (:mod:`specserve.core.ranked_tree`), accepted by
  ``verify_tree_greedy`` and ``verify_tree``; per set and gamma tau (1 + accepted per drafted round), the
  acceptance per depth, nodes per drafted round, and the target's pass over 1 + nodes positions (an explicit
  tree mask) over a decode step, interleaved medians. Their own table in the card.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specserve.api.params import SamplingParams
from specserve.bench import markdown as md
from specserve.bench.draft_card import _prompt_ids, target_greedy
from specserve.bench.head_projection import gpu_like_speedup, wire_mb_per_s
from specserve.bench.options import HeadCardOptions
from specserve.bench.timing import Laps
from specserve.core import features as wire
from specserve.core.proposal import DraftProposal
from specserve.core.ranked_tree import TreeBudget
from specserve.core.sampling import logits_to_probs
from specserve.core.tree import MAX_TREE_NODES, DraftTree
from specserve.core.tree_verification import verify_tree, verify_tree_coupled, verify_tree_greedy
from specserve.core.verification import verify_batch
from specserve.draft.feature_proposer import FeatureProposer
from specserve.draft.proposers import DraftRequest
from specserve.engine.feature_head import FeatureHead, load_feature_head
from specserve.engine.feature_maker import FeatureMaker
from specserve.engine.kvcache import SessionCacheStore
from specserve.prompts.chat import heldout_prompts


def _proposer(head: FeatureHead, *, expand: bool = True) -> FeatureProposer:
    # No prefix cache: each prompt's context is computed from its own features, as the card has always read it.
    store = SessionCacheStore(head, max_sessions=8, budget_bytes=1 << 30, ttl_s=3600, prefix_cache=False)
    return FeatureProposer(head, store, expand=expand)


@torch.inference_mode()
def sequence_features(features: FeatureMaker, tokens: list[int]) -> wire.FeatureBlock:
    """The target's features of positions ``[0, len(tokens) - 1)`` from one pass, as the target ships them."""
    with features.tap() as tap:
        features.model.get_decoder()(input_ids=torch.tensor([tokens[:-1]]))
    return wire.encode(tap.rows(0, len(tokens) - 1), 0)


def replay_greedy(
    proposer: FeatureProposer, features: FeatureMaker, prompt: list[int], continuation: list[int], gamma: int, key: str
) -> dict[str, int]:
    """Greedy rounds of the head replayed on the target's continuation (``features``: its maker of the head's
    feature), from the session's first round (the prompt's features, as the first verify pass returns them) on."""
    block = sequence_features(features, prompt + continuation)
    params = SamplingParams(temperature=0.0)
    seq = list(prompt)
    sent = 0  # features relayed so far: positions [0, sent)
    proposed = accepted = rounds = drafted = rows = 0
    j = 0
    while j < len(continuation):
        g = min(gamma, len(continuation) - j - 1)
        k = 0
        if g > 0:
            new = block.slice(sent, len(seq) - 1)
            rows += new.count
            sent = len(seq) - 1
            drafted_tokens = proposer.propose(DraftRequest(key, tuple(seq), g, params, 0, features=new)).token_ids
            while k < len(drafted_tokens) and drafted_tokens[k] == continuation[j + k]:
                k += 1
            proposed += len(drafted_tokens)
            accepted += k
            drafted += 1
        take = continuation[j : j + k + 1]
        seq += take
        j += len(take)
        rounds += 1
    proposer.release(key)
    return {"proposed": proposed, "accepted": accepted, "rounds": rounds, "drafted_rounds": drafted, "rows": rows}


@torch.inference_mode()
def sampled_rounds(
    proposer: FeatureProposer, features: FeatureMaker, prompt: list[int], max_new: int, gamma: int,
    params: SamplingParams, eos: int, key: str,
) -> dict[str, int]:
    """Real speculative sampling with the head and specserve's verifier; the features of each round's
    committed positions come from the target's own verify pass (``features``: its maker of the head's feature)."""
    target = features.model
    cache = DynamicCache(config=target.config)
    seq = list(prompt)
    with features.tap() as tap:
        target(input_ids=torch.tensor([seq[:-1]]), cache=cache, use_cache=True)
    kept = tap.rows(0, len(seq) - 1)  # [len(seq) - 1, hidden]: positions whose KV is cached
    sent = 0
    proposed = accepted = rounds = new = 0
    while new < max_new:
        g = min(gamma, max_new - new - 1)
        props: tuple[int, ...] = ()
        probs = None
        if g > 0:
            block = wire.encode(kept[sent:], sent)
            sent = len(seq) - 1
            drafted = proposer.propose(DraftRequest(key, tuple(seq), g, params, params.seed or 0, features=block))
            props = drafted.token_ids
            probs = drafted.probs_f32.double() if drafted.probs_f32 is not None else None
        with features.tap() as tap:
            logits = target(
                input_ids=torch.tensor([[seq[-1], *props]]), cache=cache, use_cache=True
            ).logits[0].float()  # [g + 1, vocab]
        p = logits_to_probs(logits, params, None)
        outcome = verify_batch(p[None], [DraftProposal(props, probs)], [params.seed], [len(seq)])[0]
        out = outcome.emitted(props)
        # The pending token and the accepted drafts are committed: their features (and KV) stay.
        kept = torch.cat([kept, tap.rows(0, outcome.accepted + 1)])
        if len(props) > outcome.accepted:
            cache.crop(outcome.accepted - len(props))
        proposed += len(props)
        accepted += outcome.accepted
        rounds += 1
        seq += out
        new += len(out)
        if eos in out:
            break
    proposer.release(key)
    return {"proposed": proposed, "accepted": accepted, "rounds": rounds, "tokens": new}


@torch.inference_mode()
def step_costs(target, head: FeatureHead, *, context: int, steps: int, warmup: int = 5) -> dict:
    """Medians of interleaved target decode steps and head draft steps after ``context`` tokens, in ms."""
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (context,), generator=g)
    tc, hc = DynamicCache(config=target.config), DynamicCache(config=head.config)
    target(input_ids=ids[None], cache=tc, use_cache=True)
    feats = torch.randn(1, context, head.config.hidden_size, generator=g)
    head(ids[None], feats, position_ids=torch.arange(context)[None], cache=hc)
    laps = Laps(warmup)
    for _ in laps.rounds(steps):
        tok = torch.randint(0, vocab, (1, 1), generator=g)
        with laps.time("target"):
            target(input_ids=tok, cache=tc, use_cache=True)
        with laps.time("head"):
            step = head(tok, feats[:, :1], position_ids=torch.tensor([[context]]), cache=hc)
            head.scatter(step.logits)
        tc.crop(-1)
        hc.crop(-1)
    target_step, head_step = laps.median_ms("target"), laps.median_ms("head")
    return {
        "target_step_ms": target_step,
        "head_step_ms": head_step,
        "head_over_target_step": head_step / target_step,
        "context_tokens": context,
        "steps": steps,
    }


# ---- draft trees (the draft's own ranking, specserve/core/ranked_tree.py) --------------------------------------


def _tree_of(tokens: tuple[int, ...], parents: tuple[int, ...], q: torch.Tensor | None) -> DraftTree:
    """A proposal as a tree (a chain where ``parents`` is empty); ``q`` ``[chain, vocab]``: the chain's rows,
    the alternatives after it point masses, as the draft ships them."""
    if q is not None and q.shape[0] < len(tokens):
        alternatives = torch.zeros(len(tokens) - q.shape[0], q.shape[1], dtype=q.dtype)  # [nodes - chain, vocab]
        alternatives[torch.arange(alternatives.shape[0]), torch.tensor(tokens[q.shape[0] :])] = 1.0
        q = torch.cat([q, alternatives])  # [nodes, vocab]
    return DraftTree(tokens, parents, q) if parents else DraftTree.from_chain(tokens, q)


def _greedy_targets(tree: DraftTree, continuation: list[int], j: int) -> torch.Tensor:
    """``[nodes + 1]``: the target's greedy token after the root and after each node whose path is the
    continuation's ``continuation[j:]`` (-1, which no node carries, after any other node)."""
    out = [continuation[j]]
    for node in range(tree.nodes):
        path = [tree.tokens[v] for v in tree.path(node)]
        on = path == continuation[j : j + len(path)]
        out.append(continuation[j + len(path)] if on else -1)
    return torch.tensor(out, dtype=torch.int64)


def replay_greedy_tree(
    proposer: FeatureProposer, features: FeatureMaker, prompt: list[int], continuation: list[int], gamma: int,
    tree: TreeBudget, key: str,
) -> dict:
    """:func:`replay_greedy` with the draft's tree under ``tree``, accepted by :func:`verify_tree_greedy`: the
    longest path equal to the target's continuation, then its next token."""
    block = sequence_features(features, prompt + continuation)
    params = SamplingParams(temperature=0.0)
    seq = list(prompt)
    sent = 0
    nodes = accepted = rounds = drafted = 0
    per_depth = [0] * gamma
    j = 0
    while j < len(continuation):
        g = min(gamma, len(continuation) - j - 1)
        take = continuation[j : j + 1]
        if g > 0:
            new = block.slice(sent, len(seq) - 1)
            sent = len(seq) - 1
            got = proposer.propose(DraftRequest(key, tuple(seq), g, params, 0, features=new, tree=tree))
            proposal = _tree_of(got.token_ids, got.parents, None)
            outcome = verify_tree_greedy(_greedy_targets(proposal, continuation, j), proposal)
            take = list(outcome.emitted)
            nodes += proposal.nodes
            accepted += outcome.accepted
            drafted += 1
            for d in range(outcome.accepted):
                per_depth[d] += 1
        seq += take
        j += len(take)
        rounds += 1
    proposer.release(key)
    return {"nodes": nodes, "accepted": accepted, "rounds": rounds, "drafted_rounds": drafted, "per_depth": per_depth}


@torch.inference_mode()
def _tree_pass(target: Any, seq: list[int], tree: DraftTree) -> torch.Tensor:
    """The target's logits ``[nodes + 1, vocab]`` after ``seq`` and after each node of ``tree``, from one pass
    over ``seq`` and the nodes, each node attending to the sequence and its own path."""
    from specserve.engine.batching import tree_pass_inputs

    n = len(seq)
    inputs = tree_pass_inputs(0, n + tree.nodes, tree.parents, torch.float32, "cpu")  # mask and positions
    logits = target(input_ids=torch.tensor([[*seq, *tree.tokens]]), **inputs).logits[0]  # [n + nodes, vocab]
    return logits[n - 1 :].float()


def sampled_tree_rounds(
    proposer: FeatureProposer, features: FeatureMaker, prompt: list[int], max_new: int, gamma: int, tree: TreeBudget,
    params: SamplingParams, eos: int, key: str, draft_params: SamplingParams | None = None,
) -> dict:
    """:func:`sampled_rounds` with the draft's tree under ``tree``, accepted by :func:`verify_tree` (recursive
    rejection sampling without replacement), or in the coupled mode by :func:`verify_tree_coupled`. Each round's features come from a pass over the committed text
    (:func:`sequence_features`) and the target's rows from a pass over it and the tree: simple, not fast.
    ``draft_params``: the draft's settings where they differ from the target's (greedy: every node a ranked
    point mass, the chain the head's argmax; still exact, as any point mass is)."""
    seq = list(prompt)
    sent = 0
    nodes = accepted = rounds = new = drafted = 0
    per_depth = [0] * gamma
    while new < max_new:
        g = min(gamma, max_new - new - 1)
        proposal = DraftTree((), ())
        if g > 0:
            block = sequence_features(features, seq).slice(sent, len(seq) - 1)
            sent = len(seq) - 1
            got = proposer.propose(
                DraftRequest(key, tuple(seq), g, draft_params or params, params.seed or 0, features=block, tree=tree)
            )
            q = got.probs_f32.double() if got.probs_f32 is not None else None
            proposal = _tree_of(got.token_ids, got.parents, q)
        p = logits_to_probs(_tree_pass(features.model, seq, proposal), params, None)  # [nodes + 1, vocab]
        if params.coupled:
            outcome = verify_tree_coupled(p, proposal, params.seed or 0, len(seq))
        else:
            outcome = verify_tree(p, proposal, params.seed or 0, len(seq))
        if proposal.nodes:
            drafted += 1
            for d in range(outcome.accepted):
                per_depth[d] += 1
        nodes += proposal.nodes
        accepted += outcome.accepted
        rounds += 1
        seq += outcome.emitted
        new += len(outcome.emitted)
        if eos in outcome.emitted:
            break
    proposer.release(key)
    return {"nodes": nodes, "accepted": accepted, "rounds": rounds, "drafted_rounds": drafted,
            "per_depth": per_depth, "tokens": new, "token_ids": seq[len(prompt) :]}  # fmt: skip


@torch.inference_mode()
def tree_pass_costs(target: Any, *, context: int, max_positions: int, steps: int, warmup: int = 5) -> dict:
    """Medians of interleaved target passes after ``context`` tokens: a decode step, and a pass over ``k``
    positions (``k`` = 1 .. ``max_positions``) with an explicit attention mask, as a tree's verify pass runs,
    each over the decode step."""
    from specserve.engine.batching import tree_pass_inputs

    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(0, vocab, (1, context), generator=g), cache=cache, use_cache=True)
    masks = {  # the pending token, then k - 1 nodes: each pass's mask and positions
        k: tree_pass_inputs(context, k, tuple(range(-1, k - 2)), torch.float32, "cpu") for k in range(1, max_positions + 1)
    }
    laps = Laps(warmup)
    for _ in laps.rounds(steps):
        with laps.time("decode"):
            target(input_ids=torch.randint(0, vocab, (1, 1), generator=g), cache=cache, use_cache=True)
        cache.crop(-1)
        for k, inputs in masks.items():
            ids = torch.randint(0, vocab, (1, k), generator=g)
            with laps.time(f"pass{k}"):
                target(input_ids=ids, cache=cache, use_cache=True, **inputs)
            cache.crop(-k)
    decode = laps.median_ms("decode")
    return {
        "decode_step_ms": decode,
        "pass_over_decode": {str(k): laps.median_ms(f"pass{k}") / decode for k in masks},
        "context_tokens": context,
        "steps": steps,
    }


def _tree_row(tot: dict, costs: dict | None) -> dict:
    """A tree row of the card from summed replay counts: tau, nodes per drafted round, per-depth acceptance
    (the share of drafted rounds that accepted a node at that depth), and the verify pass over 1 + nodes
    positions over a decode step (the measured pass nearest that size)."""
    drafted = max(1, tot["drafted_rounds"])
    nodes = tot["nodes"] / drafted
    row = {
        "tau": 1.0 + tot["accepted"] / drafted,
        "nodes_per_round": nodes,
        "per_depth": [a / drafted for a in tot["per_depth"]],
        "drafted_rounds": tot["drafted_rounds"],
        "rounds": tot["rounds"],
    }
    if costs is not None:
        sizes = sorted(int(k) for k in costs["pass_over_decode"])
        k = min(sizes, key=lambda s: abs(s - (1.0 + nodes)))
        row["verify_over_decode"] = costs["pass_over_decode"][str(k)]
    return row


@dataclass(frozen=True)
class HeadPair:
    """The target (float32) and the feature head as the card replays them: the head's feature made on the
    target's side (a fused head's projection included) and a proposer of the head with no prefix cache."""

    target_dir: Path
    head_dir: Path
    tokenizer: Any
    target: Any
    head: FeatureHead
    features: FeatureMaker
    proposer: FeatureProposer


def load_head_pair(target: str | None, head: str | None, threads: int) -> HeadPair:
    """The default target and head, or those named (a registered name or a directory), on ``threads`` threads."""
    from specserve.engine.model_registry import DEFAULT_HEAD, resolve_model
    from specserve.engine.models import resolve_model_path

    torch.set_num_threads(threads)
    target_dir = resolve_model_path(target, "target")
    head_dir = resolve_model(head or DEFAULT_HEAD, progress=False)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    loaded = load_feature_head(head_dir, target=target_dir)
    return HeadPair(
        Path(target_dir), Path(head_dir), AutoTokenizer.from_pretrained(target_dir), model, loaded,
        FeatureMaker.for_head(model, head_dir), _proposer(loaded),
    )  # fmt: skip


def run(args: HeadCardOptions) -> dict:
    pair = load_head_pair(args.target, args.head, args.threads)
    target_dir, head_dir, tok, target = pair.target_dir, pair.head_dir, pair.tokenizer, pair.target
    head, features, proposer = pair.head, pair.features, pair.proposer
    eos = tok.eos_token_id
    row_bytes = features.hidden_size * wire.VALUE_BYTES
    result: dict = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "target": str(target_dir),
        "head": str(head_dir),
        "dtype": "float32",
        "command": args.command,
        "feature": features.name,
        "feature_row_bytes": row_bytes,
        # What a row would be with the layers' states shipped and the projection on the draft's side.
        "unprojected_row_bytes": max(1, len(features.layers)) * row_bytes,
    }
    result["costs"] = step_costs(target, head, context=args.context, steps=args.cost_steps)
    print(json.dumps(result["costs"], indent=1), flush=True)
    tree_costs = None
    if args.tree_nodes:
        result["tree"] = {
            "nodes": args.tree_nodes, "min_path_probability": args.tree_min_path_probability, "expanded": True,
        }  # fmt: skip
        widest = min(max(*args.gammas, *args.sampled_gammas) + args.tree_nodes, MAX_TREE_NODES) + 1
        tree_costs = tree_pass_costs(target, context=args.context, max_positions=widest, steps=args.cost_steps)
        result["tree_costs"] = tree_costs
    for kind in ("chat", "code"):
        prompts = heldout_prompts(kind, args.prompts)
        ids = [_prompt_ids(tok, p) for p in prompts]
        refs = [target_greedy(target, p, args.max_new_tokens, eos) for p in ids]
        greedy = {}
        for gamma in args.gammas:
            tot = {"proposed": 0, "accepted": 0, "rounds": 0, "drafted_rounds": 0, "rows": 0}
            for n, (p, ref) in enumerate(zip(ids, refs, strict=True)):
                for key, v in replay_greedy(proposer, features, p, ref, gamma, f"{kind}-{n}").items():
                    tot[key] += v
            committed = sum(len(r) for r in refs)
            greedy[gamma] = {
                "acceptance": tot["accepted"] / max(1, tot["proposed"]),
                "accepted_per_round": tot["accepted"] / max(1, tot["drafted_rounds"]),
                "proposed": tot["proposed"],
                "rounds": tot["rounds"],
                "feature_bytes_per_token": tot["rows"] * row_bytes / max(1, committed),
            }
        sampled = {}
        for gamma in args.sampled_gammas:
            tot = {"proposed": 0, "accepted": 0, "rounds": 0, "tokens": 0}
            for n, p in enumerate(ids[: args.sampled_prompts]):
                params = SamplingParams(temperature=0.7, seed=1000 + n)
                got = sampled_rounds(proposer, features, p, args.sampled_tokens, gamma, params, eos, f"s-{kind}-{n}")
                for key, v in got.items():
                    tot[key] += v
            sampled[gamma] = {
                "acceptance": tot["accepted"] / max(1, tot["proposed"]),
                "accepted_per_round": tot["accepted"] / max(1, tot["rounds"]),
                "proposed": tot["proposed"],
                "rounds": tot["rounds"],
            }
        result[kind] = {
            "prompts": len(ids),
            "greedy_tokens": sum(len(r) for r in refs),
            "max_new_tokens": args.max_new_tokens,
            "greedy": greedy,
            "t0.7": sampled,
            "t0.7_prompts": min(len(ids), args.sampled_prompts),
            "t0.7_max_new_tokens": args.sampled_tokens,
        }
        print(kind, json.dumps({"greedy": greedy, "t0.7": sampled}), flush=True)
        if args.tree_nodes:
            result[kind] |= _tree_rows(args, proposer, features, kind, ids, refs, eos, tree_costs)
    return result


def _tree_rows(args: HeadCardOptions, proposer: FeatureProposer, features: FeatureMaker, kind: str, ids: list[list[int]],
               refs: list[list[int]], eos: int, costs: dict | None) -> dict:
    """A set's tree rows: greedy replays and sampled rounds at each gamma with the draft's tree."""
    out: dict = {"tree_greedy": {}, "tree_t0.7": {}}
    for gamma in args.gammas:
        tree = TreeBudget(min(gamma + args.tree_nodes, MAX_TREE_NODES), args.tree_min_path_probability)
        tot: dict = {"nodes": 0, "accepted": 0, "rounds": 0, "drafted_rounds": 0, "per_depth": [0] * gamma}
        for n, (p, ref) in enumerate(zip(ids, refs, strict=True)):
            got = replay_greedy_tree(proposer, features, p, ref, gamma, tree, f"t-{kind}-{n}")
            _add(tot, got)
        out["tree_greedy"][gamma] = _tree_row(tot, costs)
    for gamma in args.sampled_gammas:
        tree = TreeBudget(min(gamma + args.tree_nodes, MAX_TREE_NODES), args.tree_min_path_probability)
        tot = {"nodes": 0, "accepted": 0, "rounds": 0, "drafted_rounds": 0, "per_depth": [0] * gamma, "tokens": 0}
        for n, p in enumerate(ids[: args.sampled_prompts]):
            params = SamplingParams(temperature=0.7, seed=1000 + n)
            got = sampled_tree_rounds(
                proposer, features, p, args.sampled_tokens, gamma, tree, params, eos, f"ts-{kind}-{n}"
            )
            _add(tot, got)
        out["tree_t0.7"][gamma] = _tree_row(tot, costs)
    print(kind, "trees", json.dumps(out), flush=True)
    return out


def _add(tot: dict, got: dict) -> None:
    """Sum ``got``'s counts of the keys ``tot`` has into it (``per_depth`` element by element)."""
    for key in tot:
        if key == "per_depth":
            tot[key] = [a + b for a, b in zip(tot[key], got[key], strict=True)]
        else:
            tot[key] += got[key]


#: The recipe of curve points recorded before runs named theirs: fresh heads, the same steps for every share.
FIXED_STEPS = "fixed steps, a fresh head"


def _recipe(meta: dict) -> str:
    """How a curve run trained, in a few words: a fixed number of epochs (steps grow with the data) or of steps
    (compute held fixed), from a fresh head or another's weights, and its feature and losses."""
    args = meta.get("args", {})
    parts = [f"{args['epochs']:g} epoch" if args.get("epochs") else "fixed steps"]
    parts.append(f"from {Path(args['init']).name}" if args.get("init") else "a fresh head")
    if args.get("feature") == "fused":
        parts.append("fused layers")
    if args.get("reg_weight", 1.0) == 0:
        parts.append("no regression")
    return ", ".join(parts)


def curve_points(run_dirs: list[Path]) -> list[dict]:
    """Per training run: its answer tokens and its last held-out evaluation (gamma-1 top-1 per kind). A
    card's JSON in place of a run directory gives the points it keeps (``curve``), so a card measured again
    keeps the curve of runs whose directories are gone."""
    points = []
    for run in run_dirs:
        if run.is_file():
            points += json.loads(run.read_text()).get("curve", [])
            continue
        meta = json.loads((run / "train_meta.json").read_text())
        evals = [h["heldout"] for h in meta["history"] if "heldout" in h]
        if not evals:
            continue
        last = evals[-1]
        points.append(
            {
                "run": run.name,
                "recipe": _recipe(meta),
                "fraction": meta["fraction"],
                "answer_tokens": meta["answer_tokens"],
                "steps": meta["step"],
                "seconds": round(meta["elapsed_s"]),
                **{f"{kind}_top1": last[kind]["top1_per_step"][0] for kind in ("chat", "code") if kind in last},
            }
        )
    return sorted(points, key=lambda p: (p.get("recipe", FIXED_STEPS), p["answer_tokens"]))


def plot_curve(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    recipes = list(dict.fromkeys(p.get("recipe", FIXED_STEPS) for p in points))
    for recipe, style in zip(recipes, ("-", "--", ":", "-."), strict=False):
        for kind, color in (("chat", "tab:blue"), ("code", "tab:orange")):
            mine = [p for p in points if p.get("recipe", FIXED_STEPS) == recipe and f"{kind}_top1" in p]
            xs = [p["answer_tokens"] for p in mine]
            ys = [p[f"{kind}_top1"] for p in mine]
            label = f"held-out {kind}" + (f" ({recipe})" if len(recipes) > 1 else "")
            ax.plot(xs, ys, marker="o", linestyle=style, color=color, label=label)
    ax.axhline(0.55, color="grey", linestyle="--", linewidth=0.8, label="break-even here (0.55)")
    ax.set_xscale("log")
    ax.set_xlabel("training answer tokens")
    ax.set_ylabel("gamma-1 acceptance (greedy)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Feature head: held-out acceptance against data size", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def projections(card: dict) -> dict:
    """Wire bytes at other hidden sizes, and the cost model's speedup for a GPU-like verify (projections)."""
    per_token = statistics.mean(card[k]["greedy"][g]["feature_bytes_per_token"] for k in ("chat", "code")
                                for g in card[k]["greedy"])
    hidden = card["feature_row_bytes"] // wire.VALUE_BYTES
    c = card["costs"]["head_over_target_step"]
    speedup = {
        kind: {str(g): gpu_like_speedup(row["accepted_per_round"], int(g), c) for g, row in card[kind]["greedy"].items()}
        for kind in ("chat", "code")
    }
    return {
        "rows_per_token": per_token / card["feature_row_bytes"],
        "wire_mb_per_s": wire_mb_per_s(per_token, hidden),
        "speedup": speedup,
    }


def render(card: dict, meta: dict | None, points: list[dict]) -> str:
    """The model card (README.md) from the figures: nothing in it is typed by hand."""
    proj = projections(card)
    costs = card["costs"]
    lines = [
        "# specserve-smollm2-head",
        "",
        "The feature head of the default pair (target `smollm2-135m-instruct`): one decoder layer that drafts",
        "from the target's own features, relayed by the coordinator (docs/design.md, \"The feature head\").",
        "Its token table and output rows are the target's, read from the target's files when it loads.",
        "",
        f"Figures: `{card['command']}` ({card['when']}, float32, {card['machine']['threads']} threads).",
        "",
        "## Held-out acceptance",
        "",
        "Greedy (T = 0): rounds replayed on the target's greedy answers; T = 0.7: real speculative sampling.",
        "",
        *md.table(
            ("set", "T", "gamma", "acceptance per token", "accepted per drafted round"),
            ((kind, label, g, f"{row['acceptance']:.3f}", f"{row['accepted_per_round']:.2f}")
             for kind in ("chat", "code")
             for label, table in (("0", card[kind]["greedy"]), ("0.7", card[kind]["t0.7"]))
             for g, row in table.items()),
            align=[md.LEFT, md.LEFT, md.RIGHT, md.RIGHT, md.RIGHT],
        ),
    ]  # fmt: skip
    lines += [
        "",
        f"{card['chat']['prompts']} held-out prompts per set (subjects never in training), up to "
        f"{card['chat']['max_new_tokens']} tokens greedy; {card['chat']['t0.7_prompts']} prompts of "
        f"{card['chat']['t0.7_max_new_tokens']} tokens at T = 0.7.",
        "",
        "## Cost",
        "",
        f"- A head draft step costs {costs['head_over_target_step']:.3f} of a target decode step "
        f"({costs['head_step_ms']:.2f} ms against {costs['target_step_ms']:.2f} ms after "
        f"{costs['context_tokens']} tokens, medians of {costs['steps']} interleaved steps).",
        f"- On the wire: {proj['rows_per_token'] * card['feature_row_bytes']:.0f} bytes per committed token "
        f"(float16 rows of {card['feature_row_bytes'] // wire.VALUE_BYTES} values, "
        f"{proj['rows_per_token']:.2f} rows per committed token, measured over the greedy rounds).",
        *(
            [
                f"- The fused feature is projected on the target: shipping its "
                f"{card['unprojected_row_bytes'] // card['feature_row_bytes']} layers' states for the draft to "
                f"project would be {proj['rows_per_token'] * card['unprojected_row_bytes']:.0f} bytes per committed "
                "token."
            ]
            if card.get("unprojected_row_bytes", card["feature_row_bytes"]) > card["feature_row_bytes"]
            else []
        ),
        "- Projected for larger targets at 10,000 committed tokens/s: "
        + ", ".join(f"hidden {h}: {mb:.0f} MB/s" for h, mb in proj["wire_mb_per_s"].items())
        + " (a projection from the measured rows per token).",
        "",
        "## Projected speedup where a verify pass costs about a decode step (a projection, not a measurement)",
        "",
        "Tokens per round (accepted + 1, greedy, measured above) over `gamma x head step + verify`, with the",
        "verify pass at 1.05 and 1.2 decode steps, as on a GPU; the head's cost ratio is this CPU's.",
        "",
        *md.table(
            ("set", "gamma", "verify 1.05", "verify 1.2"),
            ((kind, g, f"{by_cost['1.05']:.2f}x", f"{by_cost['1.2']:.2f}x")
             for kind, table in proj["speedup"].items() for g, by_cost in table.items()),
            align=[md.LEFT, md.RIGHT, md.RIGHT, md.RIGHT],
        ),
    ]  # fmt: skip
    lines += tree_section(card)
    if points:
        lines += [
            "",
            "## Data size",
            "",
            "![held-out acceptance against data size](data_size.png)",
            "",
            *md.table(
                ("run", "recipe", "share of the data", "answer tokens", "steps", "seconds", "chat gamma-1",
                 "code gamma-1"),
                ((p["run"], p.get("recipe", FIXED_STEPS), f"{p['fraction']:g}", f"{p['answer_tokens']:,}",
                  p["steps"], p["seconds"], f"{p.get('chat_top1', float('nan')):.3f}",
                  f"{p.get('code_top1', float('nan')):.3f}")
                 for p in points),
                align=[md.LEFT, md.LEFT, *[md.RIGHT] * 6],
            ),
        ]  # fmt: skip
        lines += [
            "",
            "Held-out gamma-1 acceptance of the training script's own evaluation (greedy replay of the held-out",
            "answers, top-1 equal to the target's token) at the end of each run. The runs of one recipe train on",
            "a nested share of the data (`--fraction`): at fixed steps the compute is held fixed; at a fixed",
            "number of epochs (`--epochs`) each run passes over its share that many times, so its steps grow",
            "with the data, which is what shows the effect of data. The shipped head trained longer (below).",
        ]
    if meta is not None:
        args = meta["args"]
        lines += [
            "",
            "## Training",
            "",
            f"`scripts/train_feature_head.py train` on {meta['answer_tokens']:,} answer tokens of "
            f"{meta['records']:,} target answers (`data/smollm2-answers/`, "
            + (f"the first {args['shards']} shards of each phase" if args.get("shards") else "every shard")
            + (f", code answers sampled {args['code_repeat']}x as often" if args.get("code_repeat", 1) > 1 else "")
            + f"), {meta['step']} steps of {args['batch_tokens']} tokens in {meta['elapsed_s'] / 60:.0f} "
            f"minutes on this CPU, unrolled {args['unroll']} steps on its own outputs, learning rate {args['lr']}"
            + (f", starting from the head in `{args['init']}`." if args.get("init") else "."),
        ]
    return "\n".join(lines) + "\n"


def tree_section(card: dict) -> list[str]:
    """The card's draft-tree rows in their own table ([] for a card measured without ``--tree-nodes``)."""
    if "tree" not in card:
        return []
    tree, costs = card["tree"], card.get("tree_costs")

    def cells(kind: str, label: str, g: str, row: dict) -> list[object]:
        chain = card[kind]["greedy" if label == "0" else "t0.7"].get(g)
        verify = row.get("verify_over_decode")
        return [
            kind, label, g, f"{row['tau']:.2f}", "-" if chain is None else f"{1.0 + chain['accepted_per_round']:.2f}",
            f"{row['nodes_per_round']:.1f}", " / ".join(f"{a:.2f}" for a in row["per_depth"]),
            "-" if verify is None else f"{verify:.2f}x",
        ]  # fmt: skip

    return [
        "",
        "## Draft trees from the head's ranking",
        "",
        "The same rounds with the head's tree: its chain, and its next-best tokens as siblings"
        + (" (and below the best of them, level by level, the head's own next tokens there: EAGLE-2's expansion)"
           if tree.get("expanded") else "")
        + f" wherever their path probability is at least {tree['min_path_probability']:g}, at most gamma + "
        f"{tree['nodes']} nodes "
        "(docs/design.md, \"Draft trees from the draft's ranking\"; the threshold is fixed here, the service's "
        "policy sets its own). T = 0: the longest path equal to the target's greedy answer; T = 0.7: recursive "
        "rejection sampling without replacement. tau = 1 + accepted per drafted round (the chain's beside it); "
        "per depth: the share of drafted rounds that accepted a node at that depth; verify: the target's pass "
        "over 1 + nodes positions (the measured size nearest the mean) over a decode step"
        + (f", medians of {costs['steps']} interleaved passes after {costs['context_tokens']} tokens." if costs
           else "."),
        "",
        *md.table(
            ("set", "T", "gamma", "tau, tree", "tau, chain", "nodes per round", "accepted per depth", "verify"),
            (cells(kind, label, g, row)
             for kind in ("chat", "code")
             for label, table in (("0", card[kind]["tree_greedy"]), ("0.7", card[kind]["tree_t0.7"]))
             for g, row in table.items()),
            align=[md.LEFT, md.LEFT, *[md.RIGHT] * 6],
        ),
    ]  # fmt: skip


#: The card's one hand-written section, last: where the head stands in the service (from the harness's
#: reports, docs/benchmarks), which a new rendering of the card's figures keeps.
HAND_WRITTEN = "\n## In the service"


def hand_written(readme: Path) -> str:
    """The hand-written section at the end of an existing card (:data:`HAND_WRITTEN` on), or ''."""
    text = readme.read_text() if readme.exists() else ""
    at = text.find(HAND_WRITTEN)
    return text[at:] if at >= 0 else ""


def main(opts: HeadCardOptions) -> int:
    """``specserve bench head-card``: the figures (to ``--json``; ``--from-json`` takes them instead of
    measuring) and with ``--readme`` the model card, with the data-size curve of the ``--curve`` runs."""
    points = curve_points(opts.curve)  # before --json is written: it may name the card's own JSON
    result = json.loads(opts.from_json.read_text()) if opts.from_json else run(opts)
    if points:
        result["curve"] = points
    if opts.json is not None:  # from --from-json too: the figures again, with the curve's points
        md.write_json(opts.json, result)
    if opts.readme is not None:
        meta_path = Path(result["head"]) / "training_meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
        if points:
            plot_curve(points, opts.readme.parent / "data_size.png")
        opts.readme.write_text(render(result, meta, points) + hand_written(opts.readme))
        print(f"wrote {opts.readme}")
    return 0
