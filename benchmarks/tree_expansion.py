"""What EAGLE-2's expansion below the alternatives buys the feature head's trees, and what it costs the draft.

Run::

    python -m benchmarks tree-expansion --out docs/benchmarks

The head card's held-out greedy rounds (:func:`specserve.bench.head_card.replay_greedy_tree`: the target's
greedy answer to each held-out prompt, replayed round by round; the longest tree path equal to it is accepted,
then its next token) at one gamma, for each tree budget, twice: the head's alternatives as leaves
(``FeatureProposer(expand=False)``) and expanded below, level by level
(docs/design.md, "Draft trees from the draft's ranking"). Per row: tau (1 + accepted draft tokens per drafted
round), nodes per drafted round, the share of drafted rounds that accepted a node at each depth, and the
head's work per drafted round: its passes and the positions they feed (the prompt's catch-up and the new
committed slots included, the same in both arms; counted, not timed, so the figures do not depend on what
else runs). The target's verify pass over the nodes is the head card's ``verify`` column.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks.options import TreeExpansionOptions, parse_budget
from specserve.bench import markdown as md
from specserve.bench.runner import now_utc
from specserve.core.ranked_tree import TreeBudget


def measure(pair, ids: list[list[int]], refs: list[list[int]], gamma: int, tree: TreeBudget, expand: bool,
            kind: str) -> dict:
    """One row: the replays of every prompt with the head's trees under ``tree``, expanded or not."""
    from specserve.bench.head_card import _add, _proposer, _tree_row, replay_greedy_tree

    proposer = _proposer(pair.head, expand=expand)
    work = {"passes": 0, "positions": 0}
    plain_pass = proposer._pass

    def counted(packed, feats):  # the head's passes and the positions they feed (deterministic, unlike time)
        work["passes"] += 1
        work["positions"] += packed.positions_processed
        return plain_pass(packed, feats)

    proposer._pass = counted  # type: ignore[method-assign]
    tot = {"nodes": 0, "accepted": 0, "rounds": 0, "drafted_rounds": 0, "per_depth": [0] * gamma}
    for n, (prompt, ref) in enumerate(zip(ids, refs, strict=True)):
        _add(tot, replay_greedy_tree(proposer, pair.features, prompt, ref, gamma, tree, f"{kind}-{n}"))
    drafted = max(1, tot["drafted_rounds"])
    return {
        **_tree_row(tot, None),
        "head_passes_per_round": work["passes"] / drafted,
        "head_positions_per_round": work["positions"] / drafted,
    }


def machine() -> str:
    """The CPU's model name and its kernel-relevant flags, and its cores (the gate's reading)."""
    from specserve.bench.gate import cpu_kind

    kind = cpu_kind()
    return f"{kind['cpu']} ({', '.join(kind['flags']) or 'no AVX2'}), {kind['cores']} cores"


def render(data: dict) -> str:
    s = data["settings"]
    lines = [
        "# EAGLE-2's expansion below the head's alternatives",
        "",
        f"`{data['command']}` ({data['date_utc']} UTC, {data['machine']}, {s['threads']} threads; head "
        f"`{data['head']}`; {s['prompts']} held-out prompts per set, the target's greedy answers of up to "
        f"{s['max_new_tokens']} tokens replayed at gamma {s['gamma']}; benchmarks/tree_expansion.py says how).",
        "",
        "tau = 1 + accepted draft tokens per drafted round; per depth: the share of drafted rounds that accepted a "
        "node at that depth; head passes and positions: the head's work per drafted round (the committed slots "
        "it catches up on included, the same in both arms; counted, not timed).",
        "",
    ]
    header = ("set", "budget", "alternatives", "tau", "nodes per round", "accepted per depth", "head passes",
              "head positions")  # fmt: skip
    rows = []
    for kind in data["sets"]:
        for budget, arms in data["results"][kind].items():
            alternatives, threshold = parse_budget(budget)
            for arm in ("leaves", "expanded"):
                r = arms[arm]
                rows.append([
                    kind, f"gamma + {alternatives} nodes, path >= {threshold:g}", arm, f"{r['tau']:.3f}",
                    f"{r['nodes_per_round']:.1f}", " / ".join(f"{a:.2f}" for a in r["per_depth"]),
                    f"{r['head_passes_per_round']:.2f}", f"{r['head_positions_per_round']:.1f}",
                ])  # fmt: skip
    lines += md.table(header, rows, align=[md.LEFT, md.LEFT, md.LEFT, *[md.RIGHT] * 5])
    return "\n".join(lines) + "\n"


def main(opts: TreeExpansionOptions) -> int:
    """``python -m benchmarks tree-expansion``: ``<out>/tree_expansion.json`` and ``.md``, the table printed."""
    from specserve.bench.draft_card import _prompt_ids
    from specserve.bench.head_card import load_head_pair, target_greedy
    from specserve.prompts.chat import heldout_prompts

    pair = load_head_pair(opts.target, opts.head, opts.threads)
    eos = pair.tokenizer.eos_token_id
    results: dict = {}
    for kind in opts.sets:
        ids = [_prompt_ids(pair.tokenizer, p) for p in heldout_prompts(kind, opts.prompts)]
        refs = [target_greedy(pair.target, p, opts.max_new_tokens, eos) for p in tqdm(ids, desc=f"{kind} answers")]
        results[kind] = {}
        for budget in tqdm(opts.budgets, desc=f"{kind} budgets"):
            alternatives, threshold = parse_budget(budget)
            tree = TreeBudget(opts.gamma + alternatives, threshold)
            results[kind][budget] = {
                arm: measure(pair, ids, refs, opts.gamma, tree, arm == "expanded", kind)
                for arm in ("leaves", "expanded")
            }
    return write(opts, pair, results, "tree_expansion", render)


def write(opts, pair, results: dict, name: str, render_data) -> int:
    """The run's record (its command, date, machine, head and settings with ``results``) to
    ``<out>/<name>.json`` and, as ``render_data`` renders it, ``.md``; the table printed."""
    data = {
        "command": opts.command,
        "date_utc": now_utc(),
        "machine": machine(),
        "head": pair.head_dir.name,
        "settings": opts.settings(),
        "sets": list(opts.sets),
        "results": results,
    }
    md.write(opts.out, name, render_data(data), data)
    print(render_data(data))
    return 0
