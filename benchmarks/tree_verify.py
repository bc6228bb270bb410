"""What a lone session's tree verify pass costs the target: in a padded batch of one, or in its own cache.

Run::

    python -m benchmarks tree-verify --out docs/benchmarks

The target verifies a session's draft tree in one pass (docs/design.md, "Draft trees: exact acceptance"). A
batch of sessions packs their pasts into one padded cache (:func:`specserve.engine.batching.pack`), which
copies each past; a session verified alone feeds its own cache
(:meth:`specserve.engine.kvcache.SessionCache.extend_tree`), as a lone chain always has. For each kernel path
and context length, interleaved pass by pass so that drift on a shared machine hits all alike:

* a decode step (one position, the unit);
* a chain pass over ``1 + nodes`` positions (what the cost model's measured curve prices);
* the tree's pass (the pending token, then ``nodes`` nodes: two children per node, breadth first) in a padded
  batch of one, with what the verifier then does with its keys/values (the chain part appended to the
  session's cache);
* the same tree in the session's own cache.

Each is the median in ms and over the decode step; beside them the largest difference between the two tree
passes' logits (the same computation, so float rounding only).
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from benchmarks.options import TreeVerifyOptions
from benchmarks.tree_expansion import machine
from specserve.bench import markdown as md
from specserve.bench.runner import now_utc

PATHS = ("decode", "chain", "batch of one", "own cache")


def bushy(nodes: int) -> tuple[int, ...]:
    """Parents of a tree of ``nodes`` nodes, two children per node, breadth first."""
    return tuple(-1 if i < 2 else (i - 2) // 2 for i in range(nodes))


def one_setting(model, context: int, nodes: int, pairs: int, gen: torch.Generator) -> dict:
    """Median ms of each of :data:`PATHS` after ``context`` cached tokens, and the tree passes' logit gap."""
    from specserve.engine import batching
    from specserve.engine.kvcache import SessionCache

    vocab = model.config.vocab_size
    cache = SessionCache(model, "bench")
    cache.extend(torch.randint(0, vocab, (context,), generator=gen).tolist(), logits_to_keep=1)
    cache.commit(context)
    parents = bushy(nodes)

    def feed() -> list[int]:
        return torch.randint(0, vocab, (1 + nodes,), generator=gen).tolist()

    def decode() -> None:
        cache.extend(feed()[:1])

    def chain() -> None:
        cache.extend(feed())

    def batch_of_one() -> torch.Tensor:
        ids = feed()
        row = batching.RowInput(past=tuple(cache.layer_kv()), past_len=cache.seq_len, input_ids=tuple(ids),
                                logits_needed=1 + nodes, tree=parents)
        packed = batching.pack([row], config=model.config, device=cache._device)
        logits, grown = batching.forward(model, packed)
        kv = batching.new_kv(grown, packed, 0)
        cache.append_kv([(k[:, :, :1], v[:, :, :1]) for k, v in kv], ids[:1])
        return batching.row_logits(logits, packed, 0)

    def own_cache() -> torch.Tensor:
        return cache.extend_tree(feed(), parents, logits_to_keep=1 + nodes)[0]

    runs = dict(zip(PATHS, (decode, chain, batch_of_one, own_cache), strict=True))
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    with torch.inference_mode():
        for i in range(pairs + 2):  # the first two rounds warm every shape up and are not kept
            for path, run in runs.items():
                start = time.perf_counter()
                run()
                if i >= 2:
                    times[path].append(1e3 * (time.perf_counter() - start))
                cache.truncate(context)
        state = gen.get_state()
        a = batch_of_one()
        cache.truncate(context)
        gen.set_state(state)
        b = own_cache()
        cache.truncate(context)
    ms = {p: statistics.median(v) for p, v in times.items()}
    return {"ms": ms, "over_decode": {p: ms[p] / ms["decode"] for p in PATHS},
            "logits_max_abs_difference": float((a - b).abs().max())}


def measure(opts: TreeVerifyOptions) -> dict:
    from specserve.engine.models import load_model, resolve_model_path

    torch.set_num_threads(opts.threads)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, dict[str, dict]]] = {}
    settings = [(k, c, n) for k in opts.kernels for c in opts.contexts for n in opts.nodes]
    models = {k: load_model(resolve_model_path(opts.target, "target"), device="cpu", dtype="float32", kernels=k).model
              for k in opts.kernels}  # fmt: skip
    for kernels, context, nodes in tqdm(settings, desc="tree verify", unit="setting"):
        row = one_setting(models[kernels], context, nodes, opts.pairs, gen)
        results.setdefault(kernels, {}).setdefault(str(context), {})[str(nodes)] = row
    return {"command": opts.command, "date_utc": now_utc(), "machine": machine(), "target": opts.target,
            "settings": {"threads": opts.threads, "pairs": opts.pairs}, "results": results}  # fmt: skip


def render(data: dict) -> str:
    s = data["settings"]
    rows = []
    for kernels, by_context in data["results"].items():
        for context, by_nodes in by_context.items():
            for nodes, r in by_nodes.items():
                o, ms = r["over_decode"], r["ms"]
                rows.append((kernels, context, nodes, f"{ms['decode']:.1f}", f"{o['chain']:.2f}",
                             f"{o['batch of one']:.2f}", f"{o['own cache']:.2f}",
                             f"{ms['own cache'] / ms['batch of one']:.2f}", f"{r['logits_max_abs_difference']:.1e}"))
    return "\n".join([
        "# A lone session's tree verify pass: a padded batch of one against its own cache",
        "",
        f"Measured {data['date_utc']} UTC on {data['machine']}, {s['threads']} torch threads, target "
        f"`{data['target']}` in float32; one run of:",
        "",
        *md.command_block(data["command"]),
        f"Medians of {s['pairs']} interleaved rounds (benchmarks/tree_verify.py). Per kernel path, context and tree "
        "size: a decode step in ms, then a chain pass over 1 + nodes positions, the tree's pass (the pending token "
        "and the nodes) in a padded batch of one, and in the session's own cache, each over the decode step; the "
        "own cache's time over the batch's, and the largest difference between the two tree passes' logits.",
        "",
        *md.table(("kernels", "context", "nodes", "decode ms", "chain", "tree, batch of one", "tree, own cache",
                   "own / batch", "logits' largest difference"), rows),
        "",
    ])  # fmt: skip


def main(opts: TreeVerifyOptions) -> int:
    """``python -m benchmarks tree-verify``: ``<out>/tree_verify.json`` and ``tree_verify.md``."""
    data = measure(opts)
    text = render(data)
    print(text)
    md.write(opts.out, "tree_verify", text, data)
    return 0
