"""Draft trees against chains: the feature head's default request, drafting trees, against the same head
drafting chains, through the same workers, beside HF generate().

Run (on the speed gate's seven held-out kinds)::

    python -m benchmarks trees --out DIR

One stack of one process per role (:func:`specserve.launch.local.start_process_stack`: the target on its
defaults, the draft serving the feature head) and two coordinators on its workers
(:meth:`~specserve.launch.local.ProcessStack.add_coordinator`): one on the default settings (head trees,
``draft_tree_nodes`` 8 under the adaptive policy's threshold) and one with ``draft_tree_nodes=0`` (chains), so
both arms run the same models, the same target calibration and the same caches' code on the same machine. A third
coordinator on the same workers runs two untimed generations first, so that neither arm's cost model learns the
workers' slow first calls (the arm that met them held gamma 0 on chat and code, whichever it was).
Each prompt's turn runs, one stream at a time, greedy, EOS ignored, in this order (reversed every other pass):
HF generate() (stock transformers, float32, the target alone), trees, chains, HF generate() again (the A/A
control); each arm's generation prefills its whole prompt, as HF does (a cache salt of its own,
:func:`specserve.bench.gate.own_cache_salt`: the arm that ran second would otherwise find the first's prompt
in the target's prefix cache). Per kind: median ms/token, trees over chains (the median, min and max over (prompt, pass) pairs of
chains' ms/token over trees'), each over HF; from the generations' stats: drafted rounds, nodes per drafted
round (proposed / drafted rounds), tau = 1 + accepted per drafted round; the mean gamma of the rounds the
policy gave a gamma above 0 (the arm's coordinator's ``specserve_coordinator_gamma`` histogram, read around
each generation); greedy outputs against HF's token by token.

**A projection, not a measurement**: :func:`specserve.bench.head_projection.gpu_like_speedup` of each arm's
tau and draft steps per drafted round, with a verify pass over any number of positions at 1.05 and 1.2 decode
steps (as on a GPU with spare parallelism) and a head step at its card's measured ratio. A chain's draft steps
are its tokens; a tree's alternatives beside the chain come from the chain's own steps, so its draft steps are
its chain's tokens, which the stats do not count: the mean gamma stands in (capped at the nodes), at least the
chain's length, plus the passes that expanded trees below their alternatives (the coordinator's
``specserve_coordinator_draft_expansion_passes_total``), each charged as one step though it feeds more.
Per arm the report also gives the draft calls' time per drafted round (``GenerationStats.draft_ns``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.options import TreesOptions
from specserve.bench import gate
from specserve.bench import markdown as md
from specserve.bench.head_projection import PROJECTED_VERIFY_COSTS, gpu_like_speedup
from specserve.bench.pair import hf_generate
from specserve.bench.runner import head_info, head_overrides, now_utc, resolve_pair
from specserve.bench.timing import timed_stream

HF, HF_AGAIN = gate.HF, gate.HF_AGAIN
TREES = "specserve head trees (default)"
CHAINS = "specserve head chains (draft_tree_nodes=0)"
#: A prompt's turn, in this order (reversed every other pass).
ORDER = (HF, TREES, CHAINS, HF_AGAIN)
ARMS = (TREES, CHAINS)
#: Each arm's coordinator settings over the stack's defaults.
ARM_SETTINGS: dict[str, dict[str, Any]] = {TREES: {}, CHAINS: {"draft_tree_nodes": 0}}
GAMMA = "specserve_coordinator_gamma"
BRANCHES = "specserve_coordinator_branch_nodes_total"
EXPANSIONS = "specserve_coordinator_draft_expansion_passes"
#: A coordinator that warms the workers up before either arm's, and its generations.
WARMER = "warm-up"
WARM_UP_GENERATIONS = 2


@dataclass
class Generation(gate.Generation):
    #: The gammas above 0 the arm's coordinator chose for the generation's rounds: their sum and count.
    gamma_sum: float = 0.0
    gamma_rounds: int = 0
    #: Nodes the hybrid lookup's free branches added to the generation's trees (the arm's coordinator's
    #: ``specserve_coordinator_branch_nodes_total``, read around it).
    branch_nodes: float = 0.0
    #: The draft calls' time as the coordinator saw them (``GenerationStats.draft_ns``), ms.
    draft_ms: float = 0.0
    #: The draft's passes that expanded the generation's trees (the arm's coordinator's
    #: ``specserve_coordinator_draft_expansion_passes_total``, read around it).
    expansion_passes: float = 0.0


def _arm_stats(gens: list[Generation], head_ratio: float | None) -> dict[str, Any]:
    """Summed stats of an arm's generations: rounds, drafted rounds, nodes, gamma and tau per drafted round,
    the draft steps the projection charges and the projection itself (None without a head ratio)."""
    rounds = sum(g.rounds for g in gens)
    drafted = sum(g.draft_rounds for g in gens)
    proposed = sum(g.proposed for g in gens)
    accepted = sum(g.accepted for g in gens)
    gamma = sum(g.gamma_sum for g in gens) / max(1, sum(g.gamma_rounds for g in gens))
    out: dict[str, Any] = {
        "rounds": rounds,
        "draft_rounds": drafted,
        "proposed": proposed,
        "accepted": accepted,
        "branch_nodes": sum(g.branch_nodes for g in gens),
        "expansion_passes": sum(g.expansion_passes for g in gens),
    }
    if not drafted:
        return out
    nodes, accepted_per_round = proposed / drafted, accepted / drafted
    expansions = sum(g.expansion_passes for g in gens) / drafted
    steps = nodes if gens[0].mode == CHAINS else min(nodes, gamma) + expansions
    out.update(
        nodes_per_round=nodes,
        gamma_per_round=gamma,
        tau=1.0 + accepted_per_round,
        draft_ms_per_round=sum(g.draft_ms for g in gens) / drafted,
        draft_steps_per_round=steps,
        projection=None if head_ratio is None else gpu_like_speedup(accepted_per_round, steps, head_ratio),
    )
    return out


def summarize(gens: list[Generation], kinds: list[str], head_ratio: float | None) -> dict[str, Any]:
    """Per kind: each mode's median ms/token and speed over HF (median, min, max over pairs), trees over
    chains, each arm's stats and projection, and greedy identity with HF."""
    table: dict[str, dict[str, Any]] = {}
    timed: list[gate.Generation] = list(gens)
    for kind in kinds:
        rows: dict[str, Any] = {}
        for mode in ORDER:
            mine = [g for g in gens if g.kind == kind and g.mode == mode]
            if not mine:
                continue
            row: dict[str, Any] = {
                "ms_per_token": statistics.median(g.ms_per_token for g in mine),
                "n": len(mine),
            }
            r = gate._ratios(timed, mode, HF, kind)
            if r:
                row["vs_hf"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
            if mode in ARMS:
                ref = {(g.prompt, g.repeat): g.token_ids for g in gens if g.kind == kind and g.mode == HF}
                row["identical"] = sum(g.token_ids == ref.get((g.prompt, g.repeat)) for g in mine)
                row.update(_arm_stats(mine, head_ratio))
            rows[mode] = row
        r = gate._ratios(timed, TREES, CHAINS, kind)
        table[kind] = {"modes": rows}
        if r:
            table[kind]["trees_over_chains"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    identity = {
        arm: {"identical": sum(table[k]["modes"].get(arm, {}).get("identical", 0) for k in kinds),
              "of": sum(table[k]["modes"].get(arm, {}).get("n", 0) for k in kinds)}
        for arm in ARMS
    }  # fmt: skip
    proposers = {arm: sorted({g.proposer for g in gens if g.mode == arm and g.proposer}) for arm in ARMS}
    return {"table": table, "greedy_identity": identity, "proposers": proposers}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"  # older records have no draft time


def _ratio(v: dict[str, float] | None) -> str:
    return "-" if v is None else f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"


def render(data: dict[str, Any]) -> str:
    """The report: the CPU, the command, the speeds, the arms' stats and the projection."""
    cpu = data["cpu_kind"]
    summary = data["summary"]
    kinds = list(summary["table"])
    s = data["settings"]
    lines = [
        f"## Draft trees against chains, {data['date_utc']} UTC, {data['lscpu_model'] or cpu['cpu']}",
        "",
        f"CPU: {cpu['cpu']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or '-'}; torch {cpu['torch']}; "
        f"load average {data['load_average']['before'][0]:.2f} before, {data['load_average']['after'][0]:.2f} after.",
        "",
        *md.command_block(data["command"]),
        f"{s['max_new_tokens']} tokens per generation, greedy, EOS ignored, one stream at a time; {s['repeats']} "
        f"interleaved passes; gamma {'the policy' if s['gamma'] is None else s['gamma']}; settings beside the "
        f"arms': {' '.join(s['setting']) or 'none'}. One stack (the target, the draft serving the head) and two coordinators on its "
        "workers: the default settings (trees) and `draft_tree_nodes=0` (chains). Proposers: "
        + "; ".join(f"{arm}: {', '.join(p) or '-'}" for arm, p in summary["proposers"].items())
        + ".",
        "",
        "Median ms/token, then the median (min-max over prompts and passes) speed over HF generate() in the same "
        "turn:",
        "",
    ]
    rows = []
    for mode in ORDER:
        cells = [mode]
        for kind in kinds:
            row = summary["table"][kind]["modes"].get(mode)
            cells.append("-" if row is None else f"{row['ms_per_token']:.1f} ({_ratio(row.get('vs_hf'))})")
        rows.append(cells)
    rows.append(["trees over chains", *(_ratio(summary["table"][k].get("trees_over_chains")) for k in kinds)])
    lines += md.table(["mode", *(gate.KIND_NAMES.get(k, k) for k in kinds)], rows)
    lines += [
        "",
        "From the generations' stats (per drafted round; tau = 1 + accepted per drafted round) and the "
        "coordinators' gamma histograms (mean gamma: of the rounds the policy gave a gamma above 0):",
        "",
    ]
    stat_rows = []
    for kind in kinds:
        for arm in ARMS:
            row = summary["table"][kind]["modes"].get(arm)
            if row is None:
                continue
            drafted = row["draft_rounds"]
            stat_rows.append([
                gate.KIND_NAMES.get(kind, kind), arm, row["rounds"], drafted,
                *((f"{row['nodes_per_round']:.2f}", f"{row['gamma_per_round']:.2f}", f"{row['tau']:.2f}",
                   _ms(row.get("draft_ms_per_round"))) if drafted else ("-", "-", "-", "-")),
                f"{row.get('expansion_passes', 0):.0f}",
                f"{row.get('branch_nodes', 0):.0f}", f"{row['identical']} of {row['n']}",
            ])  # fmt: skip
    lines += md.table(
        (
            "kind",
            "arm",
            "rounds",
            "drafted rounds",
            "nodes per round",
            "mean gamma",
            "tau",
            "draft ms per drafted round",
            "expansion passes",
            "lookup branch nodes",
            "identical to HF",
        ),
        stat_rows,
        align=[md.LEFT, md.LEFT, *[md.RIGHT] * 9],
    )
    ident = summary["greedy_identity"]
    lines += ["", "Greedy output identical to HF generate(), token by token: "
              + "; ".join(f"{arm} {v['identical']} of {v['of']}" for arm, v in ident.items()) + "."]  # fmt: skip
    ratio = data["head"]["head_over_target_step"] if data["head"] else None
    lines += [
        "",
        "**Projection, not a measurement**: speedup over the target alone if a verify pass over any number of "
        "positions cost " + " or ".join(f"{v:g}" for v in PROJECTED_VERIFY_COSTS) + " decode steps (as on a "
        "GPU), a head step "
        + (f"{ratio:.3f}" if ratio is not None else "unknown (the head has no card.json: no projection)")
        + " of a target step (the head card's measurement), per drafted round: tau over (draft steps x head "
        "step + verify). Draft steps: a chain's tokens; for trees the mean gamma above (at most the nodes), at "
        "least its chain's length (the alternatives beside it cost no step), plus the expansion passes per "
        "drafted round, each charged one step.",
        "",
    ]
    proj_rows = []
    for kind in kinds:
        for arm in ARMS:
            row = summary["table"][kind]["modes"].get(arm)
            proj = None if row is None else row.get("projection")
            if proj is None:
                continue
            proj_rows.append([gate.KIND_NAMES.get(kind, kind), arm, f"{row['draft_steps_per_round']:.2f}",
                              *(f"{proj[str(v)]:.2f}x" for v in PROJECTED_VERIFY_COSTS)])  # fmt: skip
    if proj_rows:
        lines += md.table(
            ("kind", "arm", "draft steps per round",
             *(f"speedup, verify {v:g}x a step (projection)" for v in PROJECTED_VERIFY_COSTS)),
            proj_rows,
            align=[md.LEFT, md.LEFT, *[md.RIGHT] * (1 + len(PROJECTED_VERIFY_COSTS))],
        )  # fmt: skip
    return "\n".join(lines) + "\n"


async def measure(opts: TreesOptions) -> list[Generation]:
    """Every (pass, prompt, mode) generation; see the module docstring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.bench.prom import scrape
    from specserve.client import AsyncClient
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import free_port, private_redis

    torch.set_num_threads(opts.threads)
    tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(
        opts.target, local_files_only=True, dtype=torch.float32
    ).eval()
    # The gate's held-out prompts: its reader takes kinds, prompts, task_prompts and target, as these options have.
    prompts = gate._prompts(opts, tokenizer)  # type: ignore[arg-type]
    metrics = {arm: free_port() for arm in ARMS}
    settings = opts.overrides()
    coordinator = {
        arm: {**settings["coordinator"], **ARM_SETTINGS[arm], "metrics_port": metrics[arm]} for arm in ARMS
    }
    request = {} if opts.gamma is None else {"gamma": opts.gamma}
    gens: list[Generation] = []
    with private_redis(opts.redis_url) as url:
        stack = await start_process_stack(
            target_model=opts.target, draft_model=opts.draft, redis_url=url, target_overrides=settings["target"],
            draft_overrides={**head_overrides(opts), **settings["draft"]}, coordinator_overrides=coordinator[TREES],
            start_timeout_s=opts.start_timeout_s,
        )  # fmt: skip
        clients: dict[str, Any] = {}
        try:
            chains = await stack.add_coordinator(coordinator[CHAINS], start_timeout_s=opts.start_timeout_s)
            clients = {
                TREES: AsyncClient(stack.address, timeout=600),
                CHAINS: AsyncClient(chains, timeout=600),
            }
            # The workers' first calls are slow; the arm that met them learnt their costs, held gamma 0 and, its
            # probes rare, kept it (trees.md, "Which arm meets the workers first"). A coordinator of its own
            # meets them first, so that both arms start on warm workers.
            warmer = await stack.add_coordinator({"metrics_port": free_port()}, start_timeout_s=opts.start_timeout_s)
            clients[WARMER] = AsyncClient(warmer, timeout=600)
            first = next(iter(prompts.values()))[0][1]
            for _ in range(WARM_UP_GENERATIONS):
                await timed_stream(clients[WARMER].stream(
                    prompt_token_ids=first, max_new_tokens=opts.max_new_tokens, temperature=0.0, seed=opts.seed,
                    ignore_eos=True, cache_salt=gate.own_cache_salt(WARMER),
                ))  # fmt: skip

            def branch_nodes(arm: str) -> float:
                """The nodes the lookup's free branches have added to the arm's trees so far."""
                return scrape(f"http://127.0.0.1:{metrics[arm]}/metrics", BRANCHES, {"source": "ngram"})

            def expansions(arm: str) -> float:
                """The draft passes that have expanded the arm's trees so far."""
                return scrape(f"http://127.0.0.1:{metrics[arm]}/metrics", f"{EXPANSIONS}_total")

            def gammas(arm: str) -> tuple[float, int]:
                """The sum and the count of the gammas above 0 the arm's coordinator has chosen so far."""
                url = f"http://127.0.0.1:{metrics[arm]}/metrics"
                count = scrape(url, f"{GAMMA}_count") - scrape(url, f"{GAMMA}_bucket", {"le": "0.0"})
                return scrape(url, f"{GAMMA}_sum"), int(count)

            async def one(mode: str, ids: list[int]) -> tuple[list[int], float, dict[str, Any]]:
                if mode in (HF, HF_AGAIN):
                    new, seconds = hf_generate(target, ids, opts.max_new_tokens)
                    return new, seconds, {}
                before, branched, expanded = gammas(mode), branch_nodes(mode), expansions(mode)
                stream = clients[mode].stream(prompt_token_ids=ids, max_new_tokens=opts.max_new_tokens,
                                              temperature=0.0, seed=opts.seed, ignore_eos=True,
                                              cache_salt=gate.own_cache_salt(mode), **request)  # fmt: skip
                streamed = await timed_stream(stream)
                st, after = streamed.stats, gammas(mode)
                return streamed.token_ids, streamed.seconds, {
                    "proposer": st.proposer, "rounds": st.rounds, "draft_rounds": st.draft_rounds,
                    "proposed": st.proposed_tokens, "accepted": st.accepted_tokens,
                    "gamma_sum": after[0] - before[0], "gamma_rounds": after[1] - before[1],
                    "cached_tokens": st.cached_tokens, "branch_nodes": branch_nodes(mode) - branched,
                    "draft_ms": st.draft_ns / 1e6, "expansion_passes": expansions(mode) - expanded,
                }  # fmt: skip

            gens = await gate.interleaved_turns(
                prompts, list(ORDER), opts.repeats, one, Generation, desc="trees against chains"
            )
        finally:
            for client in clients.values():
                await client.close()
            await stack.stop()
    return gens


def main(opts: TreesOptions) -> int:
    """``python -m benchmarks trees``: ``<out>/trees.json`` and ``trees.md``, the report printed."""
    from specserve.runtime.logs import configure_logging

    resolve_pair(opts)
    configure_logging("console", "warning")
    cpu = gate.cpu_kind()
    lscpu = gate._lscpu_model()
    print(f"trees against chains on {lscpu or cpu['cpu']} ({cpu['cores']} cores; {' '.join(cpu['flags'])}), "
          f"torch {cpu['torch']}", flush=True)  # fmt: skip
    head = head_info(opts)
    if head is None:
        raise SystemExit(
            f"the draft {opts.draft} serves no feature head (--head {opts.head}): no trees to measure"
        )
    before = os.getloadavg()
    gens = asyncio.run(measure(opts))
    data = {
        "command": opts.command,
        "date_utc": now_utc(),
        "cpu_kind": cpu,
        "lscpu_model": lscpu,
        "settings": opts.settings(),
        "head": head,
        "arm_settings": {arm: ARM_SETTINGS[arm] for arm in ARMS},
        "load_average": {"before": list(before), "after": list(os.getloadavg())},
        "summary": summarize(gens, list(opts.kinds), head["head_over_target_step"]),
        "generations": [asdict(g) for g in gens],
    }
    text = render(data)
    print("\n" + text)
    path = md.write(opts.out, "trees", text, data)
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0
