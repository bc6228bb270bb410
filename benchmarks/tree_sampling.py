"""The feature head's trees in sampled rounds: which nodes to offer the optimal rule, and how many.

Run::

    python -m benchmarks tree-sampling --out docs/benchmarks

The head card's sampled rounds with trees (:func:`specserve.bench.head_card.sampled_tree_rounds`: held-out
prompts, each generated ``--seeds`` times at ``--temperature`` with the session seed ``1000 + prompt + 100 *
seed``; each round's tree verified against the target's rows by recursive rejection sampling without
replacement, :func:`specserve.core.tree_verification.verify_tree`), for each budget, in two arms:

- **drawn chain** (what the service does): the chain drawn from the head's q at the temperature and shipped
  with it, the alternatives and the nodes below them the head's ranking, point masses;
- **ranked**: every node a point mass from the head's ranking, the chain its argmax (the draft greedy, the
  target sampling). Also exact: a point mass's existence and token are fixed before the target draws, and the
  rule tries it against the residual of the siblings before it, so a node set accepts the target's mass on
  its tokens.

Per row: tau (1 + accepted draft tokens per drafted round), nodes per drafted round and the share of drafted
rounds that accepted a node at each depth (counted, not timed: the verify pass's cost per node is the head
card's). The arms' samples differ (each follows its own accepted tokens), so a difference is read against
the rounds counted.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks.options import TreeSamplingOptions, parse_budget
from benchmarks.tree_expansion import write
from specserve.bench import markdown as md
from specserve.core.ranked_tree import TreeBudget

ARMS = ("drawn chain", "ranked")


def measure(pair, ids: list[list[int]], opts: TreeSamplingOptions, tree: TreeBudget, arm: str, kind: str) -> dict:
    """One row: every prompt's seeded generations with the head's trees under ``tree`` in ``arm``."""
    from specserve.api.params import SamplingParams
    from specserve.bench.head_card import _add, _tree_row, sampled_tree_rounds

    eos = pair.tokenizer.eos_token_id
    tot = {"nodes": 0, "accepted": 0, "rounds": 0, "drafted_rounds": 0, "per_depth": [0] * opts.gamma, "tokens": 0}
    for n, prompt in enumerate(ids):
        for s in range(opts.seeds):
            params = SamplingParams(temperature=opts.temperature, seed=1000 + n + 100 * s)
            draft = SamplingParams(temperature=0.0, seed=params.seed) if arm == "ranked" else None
            got = sampled_tree_rounds(
                pair.proposer, pair.features, prompt, opts.max_new_tokens, opts.gamma, tree, params, eos,
                f"{arm}-{kind}-{n}-{s}", draft_params=draft,
            )  # fmt: skip
            _add(tot, got)
    return {**_tree_row(tot, None), "tokens": tot["tokens"]}


def render(data: dict) -> str:
    s = data["settings"]
    lines = [
        f"# The head's trees in sampled rounds (T = {s['temperature']:g})",
        "",
        f"`{data['command']}` ({data['date_utc']} UTC, {data['machine']}, {s['threads']} threads; head "
        f"`{data['head']}`; {s['prompts']} held-out prompts per set x {s['seeds']} seeds, {s['max_new_tokens']} "
        f"tokens each at gamma {s['gamma']}, the optimal rule; benchmarks/tree_sampling.py says how).",
        "",
        "tau = 1 + accepted draft tokens per drafted round; per depth: the share of drafted rounds that accepted a "
        "node at that depth. 'drawn chain': the chain drawn from the head's q, the other nodes its ranking (the "
        "service's trees); 'ranked': every node from the ranking, the chain the head's argmax.",
        "",
    ]
    header = ("set", "budget", "arm", "tau", "drafted rounds", "nodes per round", "accepted per depth")
    rows = []
    for kind in data["sets"]:
        for budget, arms in data["results"][kind].items():
            alternatives, threshold = parse_budget(budget)
            for arm in ARMS:
                r = arms[arm]
                rows.append([
                    kind, f"gamma + {alternatives} nodes, path >= {threshold:g}", arm, f"{r['tau']:.3f}",
                    str(r["drafted_rounds"]), f"{r['nodes_per_round']:.1f}",
                    " / ".join(f"{a:.2f}" for a in r["per_depth"]),
                ])  # fmt: skip
    lines += md.table(header, rows, align=[md.LEFT, md.LEFT, md.LEFT, *[md.RIGHT] * 4])
    return "\n".join(lines) + "\n"


def main(opts: TreeSamplingOptions) -> int:
    """``python -m benchmarks tree-sampling``: ``<out>/tree_sampling.json`` and ``.md``, the table printed."""
    from specserve.bench.draft_card import _prompt_ids
    from specserve.bench.head_card import load_head_pair
    from specserve.prompts.chat import heldout_prompts

    pair = load_head_pair(opts.target, opts.head, opts.threads)
    results: dict = {}
    for kind in opts.sets:
        ids = [_prompt_ids(pair.tokenizer, p) for p in heldout_prompts(kind, opts.prompts)]
        results[kind] = {}
        for budget in tqdm(opts.budgets, desc=f"{kind} budgets"):
            alternatives, threshold = parse_budget(budget)
            tree = TreeBudget(opts.gamma + alternatives, threshold)
            results[kind][budget] = {arm: measure(pair, ids, opts, tree, arm, kind) for arm in ARMS}
    return write(opts, pair, results, "tree_sampling", render)
