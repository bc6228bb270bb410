"""Render ``bench.json`` (from ``specserve bench all``) as a Markdown report with PNG plots.

``specserve bench report docs/benchmarks`` re-renders without re-measuring: ``README.md`` from ``bench.json``
with the latency runs' sections (``latency.json`` from ``specserve bench latency``, further runs kept as
``latency_<name>.json``; :func:`write_latency` writes each alone), and ``load.json`` (``specserve bench
load``), whose load sweep then replaces the full run's in the report (:func:`write_load`), and
``single.json`` (:func:`write_single`). The README links every other report in its folder (the one-off
experiments' reports, which ``python -m benchmarks report`` renders). Tables come from
:mod:`specserve.bench.markdown`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from specserve.bench import head_projection
from specserve.bench import markdown as md
from specserve.bench.costs import Costs, as_run, predicted_speedup
from specserve.bench.latency import section as latency_section
from specserve.bench.modes import (
    ADAPTIVE,
    FIXED_GAMMAS,
    GAMMA0,
    HF_ASSISTED,
    HF_LOOKUP_PREFIX,
    HF_TARGET,
    LOAD_ADAPTIVE,
    LOAD_BASE,
    LOAD_CONTROL,
    MODEL_ONLY,
    NGRAM_ADAPTIVE,
    fixed,
)
from specserve.bench.options import ReportOptions
from specserve.coordinator.speculation.cost_model import expected_tokens_iid

BASE = GAMMA0.name
#: A projection, not a measurement: what a pass over k positions costs on an accelerator with spare
#: parallelism, as multiples of a one-position step (1.05x at k = 2 rising to 1.2x at k = 9).
GPU_LIKE_VERIFY = (1.0, 1.05, 1.07, 1.09, 1.11, 1.14, 1.16, 1.18, 1.2)


def gpu_like(costs: Costs) -> Costs:
    """The measured costs with the verify curve replaced by :data:`GPU_LIKE_VERIFY` (draft ratio kept)."""
    step = costs.target_step_ms
    curve = [step * GPU_LIKE_VERIFY[min(k, len(GPU_LIKE_VERIFY) - 1)] for k in range(len(costs.verify_ms))]
    return Costs(target_step_ms=step, draft_step_ms=costs.draft_step_ms, verify_ms=curve)


def _alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """Solve sum_{i=1..gamma} a^i = mean accepted per round for the i.i.d. acceptance a (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_iid(mid, gamma) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return lo


def bound_rows(data: dict) -> list[dict]:
    """Predicted vs measured speedup over HF target-only, per gamma, per (set, temperature)."""
    costs = Costs(**data["costs"])
    projected_costs = gpu_like(costs)
    run_costs = as_run(costs)  # the draft step after a target pass (None: a run that did not time it)
    rows = []
    for key, group in data["single_stream"].items():
        base = group.get(HF_TARGET, {}).get("ms_per_token_median")
        set_name, temp = key.split(" T=")
        for g in FIXED_GAMMAS:
            mode = group.get(fixed(g).name)
            runs = [
                r
                for r in data["runs"]
                if r["mode"] == fixed(g).name
                and r["prompt_set"] == set_name
                and f"{r['temperature']:g}" == temp
            ]
            rounds = sum(r["rounds"] for r in runs)
            if not mode or not base or not rounds:
                continue
            alpha = _alpha_from_mean_accepted(sum(r["accepted"] for r in runs) / rounds, g)
            predicted = predicted_speedup(alpha, g, costs)
            measured = base / mode["ms_per_token_median"]
            row = {
                "key": key,
                "gamma": g,
                "alpha": alpha,
                "predicted": predicted,
                "measured": measured,
                "efficiency": measured / predicted,
                "gpu_projection": predicted_speedup(alpha, g, projected_costs),
            }
            if run_costs is not None:
                row["predicted_as_run"] = predicted_speedup(alpha, g, run_costs)
                row["efficiency_as_run"] = measured / row["predicted_as_run"]
            if all("draft_s" in r for r in runs):  # where a round's time went, against the model's parts
                parts = ("draft", "verify", "forward", "total")
                per_round = {part: 1e3 * sum(r[f"{part}_s"] for r in runs) / rounds for part in parts}
                other = per_round["total"] - per_round["draft"] - per_round["verify"]
                row["round_ms"] = per_round | {"other": other}
                row["model_round_ms"] = {
                    "draft": g * costs.draft_step_ms,
                    "verify": costs.verify_ms[min(g, len(costs.verify_ms) - 1)],  # a pass over g + 1
                }
                if run_costs is not None:
                    row["model_round_ms"]["draft_as_run"] = g * run_costs.draft_step_ms
            rows.append(row)
    return rows


def _draft_as_run_line(costs: dict) -> str:
    """The Model costs sentence on the draft step timed after a target pass ('' for runs without it)."""
    after = costs.get("draft_step_after_target_ms")
    if after is None:
        return ""
    return (
        f" The draft step right after a target pass, on {costs['draft_threads']} thread(s) as the draft runs "
        f"in the stack: {after:.2f} ms ({after / costs['draft_step_ms']:.2f}x the back-to-back step; each "
        "verify pass streams the target's weights through the CPU's caches, so this is the step every "
        "speculative round pays here, Hugging Face assisted generation's included)."
    )


def round_parts_section(rows: list[dict]) -> list[str]:
    """Where a round's time went, measured, beside the parts the bound counts: what the efficiency misses."""
    timed = [r for r in rows if "round_ms" in r]
    if not timed:
        return []
    lines = [
        "Where the efficiency goes: one round's time, measured through the service (the runs' own "
        "`GenerationStats`, summed over the set's prompts and divided by its rounds), beside the two parts "
        "the bound counts (gamma draft steps, one target pass over gamma + 1 positions, timed in-process). "
        "Draft = the Propose call as the coordinator saw it (the draft's catch-up on the last round's "
        "tokens, its steps and row-invariant batching, gRPC); verify = the Verify call (forward = the "
        "target's pass inside it); other = the rest of the round (coordinator, streaming).",
        "",
    ]
    as_run = all(r["model_round_ms"].get("draft_as_run") is not None for r in timed)
    if as_run:
        lines[0] += (
            " Where two bounds are given for the draft, the second is its steps timed right after a target "
            "pass on the stack's draft thread count (Model costs): the part of the gap that is the CPU's "
            "caches and the draft's threads, not the service."
        )
    rows = []
    for r in timed:
        m, b = r["round_ms"], r["model_round_ms"]
        draft_bound = f"{b['draft']:.1f}" + (f"; {b['draft_as_run']:.1f}" if as_run else "")
        round_bound = f"{b['draft'] + b['verify']:.1f}" + (
            f"; {b['draft_as_run'] + b['verify']:.1f}" if as_run else ""
        )
        rows.append(
            (r["key"], r["gamma"], f"{m['draft']:.1f} ({draft_bound})", f"{m['verify']:.1f} ({b['verify']:.1f})",
             f"{m['forward']:.1f}", f"{m['other']:.1f}", f"{m['total']:.1f} ({round_bound})")
        )  # fmt: skip
    header = ("prompts", "gamma", "draft ms (bound)", "verify ms (bound)", "of which forward", "other ms",
              "round ms (bound)")  # fmt: skip
    return [*lines, *md.table(header, rows), ""]


def targets(data: dict) -> list[tuple[str, bool, str]]:
    """The speed targets (docs/benchmarks), each with its verdict and the figures behind it."""
    out = []
    ss = data["single_stream"]

    def ms(group: dict, mode: str) -> float | None:
        return group.get(mode, {}).get("ms_per_token_median")

    for key, group in ss.items():
        hf, hfa = ms(group, HF_TARGET), ms(group, HF_ASSISTED)
        # the fastest of HF's prompt-lookup runs (older records hold one, at 8 tokens)
        lookups = {m: ms(group, m) for m in group if m.startswith(HF_LOOKUP_PREFIX)}
        lookups = {m: v for m, v in lookups.items() if v}
        hfl_mode = min(lookups, key=lookups.get) if lookups else None
        hfl = lookups.get(hfl_mode)
        g0, ad, ng = ms(group, BASE), ms(group, ADAPTIVE.name), ms(group, NGRAM_ADAPTIVE.name)
        if hf and g0:
            out.append(
                (
                    f"{key}: gamma=0 (overhead) >= 0.95x HF target-only",
                    hf / g0 >= 0.95,
                    f"{hf / g0:.2f}x ({hf:.2f} -> {g0:.2f} ms/token)",
                )
            )
        if hf and ad:
            out.append(
                (
                    f"{key}: adaptive >= 0.95x HF target-only",
                    hf / ad >= 0.95,
                    f"{hf / ad:.2f}x ({hf:.2f} -> {ad:.2f} ms/token)",
                )
            )
        if hfa and ad:
            out.append(
                (
                    f"{key}: adaptive not slower than HF assisted",
                    ad <= hfa,
                    f"{hfa / ad:.2f}x ({hfa:.2f} vs {ad:.2f} ms/token)",
                )
            )
        if key.startswith("copy T=0") and hf and ad and MODEL_ONLY.name in group:
            # a run with the model-only mode is one where a request that sets nothing keeps the hybrid lookup
            out.append(
                (
                    f"{key}: adaptive (a request that sets nothing) picks the copying up: >= 2x HF target-only",
                    hf / ad >= 2.0,
                    f"{hf / ad:.2f}x ({ad:.2f} ms/token; the draft model alone: "
                    f"{hf / ms(group, MODEL_ONLY.name):.2f}x)",
                )
            )
        if key.startswith("copy T=0") and hf and ng:
            out.append(
                (
                    f"{key}: n-gram adaptive >= 2x HF target-only",
                    hf / ng >= 2.0,
                    f"{hf / ng:.2f}x ({ng:.2f} ms/token)",
                )
            )
            if hfl:
                out.append(
                    (
                        f"{key}: n-gram adaptive at least as fast as HF prompt lookup",
                        ng <= hfl,
                        f"{hfl / ng:.2f}x ({hfl:.2f} vs {ng:.2f} ms/token; the faster HF run: {hfl_mode})",
                    )
                )
    for r in bound_rows(data):
        if r["gamma"] >= 2:
            out.append(
                (
                    f"{r['key']} gamma={r['gamma']}: efficiency >= 90% of the cost-model bound",
                    r["efficiency"] >= 0.9,
                    f"{r['efficiency']:.0%}",
                )
            )
    rows = {(r["rate_rps"], r["mode"]): r for r in load_rows(data["load"])}
    controls = load_ratios(data["load"], LOAD_CONTROL.name)
    for rate, ratios in load_ratios(data["load"]).items():
        ad, base = rows[(rate, LOAD_ADAPTIVE.name)], rows[(rate, LOAD_BASE.name)]
        median = statistics.median(ratios)
        spread = (
            f", {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} repeats" if len(ratios) > 1 else ""
        )
        control = controls.get(rate)
        if control:
            spread += (
                f"; gamma 0 against itself: {min(control):.2f}-{max(control):.2f}, "
                f"median {statistics.median(control):.2f}"
            )
        out.append(
            (
                f"load {rate:g} req/s: adaptive throughput >= gamma=0",
                median >= 1.0,
                f"{ad['throughput_tok_s']:.1f} vs {base['throughput_tok_s']:.1f} tok/s "
                f"(adaptive / gamma 0: {median:.2f}{spread})",
            )
        )
    return out


#: Load-point fields the report gives as a median over repeats.
_LOAD_MEDIANS = (
    "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "queue_p50_s",
    "target_forward_passes", "target_positions", "proposed_tokens", "accepted_tokens", "wasted_tokens",
)  # fmt: skip


def load_rows(points: list[dict]) -> list[dict]:
    """One row per (rate, mode), in the order first measured: the median of each figure over the
    repeats (``specserve.bench.harness.load_sweep``), the throughput's range, and requests summed."""
    groups: dict[tuple[float, str], list[dict]] = {}
    for p in points:
        groups.setdefault((p["rate_rps"], p["mode"]), []).append(p)
    rows = []
    for (rate, mode), pts in sorted(groups.items(), key=lambda kv: kv[0][0]):
        row = {k: statistics.median(p[k] for p in pts) for k in _LOAD_MEDIANS}
        row |= {
            "rate_rps": rate,
            "mode": mode,
            "repeats": len(pts),
            "throughput_min": min(p["throughput_tok_s"] for p in pts),
            "throughput_max": max(p["throughput_tok_s"] for p in pts),
            "requests": sum(p["requests"] for p in pts),
            "completed": sum(p["completed"] for p in pts),
            "errors": sum(p["errors"] for p in pts),
        }
        rows.append(row)
    return rows


def load_ratios(points: list[dict], mode: str = LOAD_ADAPTIVE.name) -> dict[float, list[float]]:
    """Per rate, ``mode``'s throughput over gamma 0's within each repeat (the two were measured minutes
    apart at most, so the machine's slower drift cancels in the ratio)."""
    by_key = {(p["rate_rps"], p.get("repeat", 0), p["mode"]): p["throughput_tok_s"] for p in points}
    out: dict[float, list[float]] = {}
    for (rate, repeat, name), tok_s in sorted(by_key.items()):
        base = by_key.get((rate, repeat, LOAD_BASE.name))
        if name == mode and base:
            out.setdefault(rate, []).append(tok_s / base)
    return out


def _plots(data: dict, out: Path) -> list[str]:
    names = []
    load = load_rows(data["load"])
    modes = list(dict.fromkeys(p["mode"] for p in load))
    if load:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for mode in modes:
            pts = [p for p in load if p["mode"] == mode]
            rates = [p["rate_rps"] for p in pts]
            axes[0].plot(rates, [1000 * p["ttft_p50_s"] for p in pts], marker="o", label=mode)
            axes[1].plot(rates, [1000 * p["itl_p50_s"] for p in pts], marker="o", label=mode)
        axes[0].set(xlabel="arrival rate (req/s)", ylabel="ms", title="time to first token, p50")
        axes[1].set(xlabel="arrival rate (req/s)", ylabel="ms", title="inter-token latency, p50")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "latency_vs_rate.png", dpi=110)
        plt.close(fig)
        names.append("latency_vs_rate.png")

        fig, ax = plt.subplots(figsize=(5.5, 4))
        for mode in modes:
            pts = [p for p in load if p["mode"] == mode]
            mid = [p["throughput_tok_s"] for p in pts]
            spread = [
                [p["throughput_tok_s"] - p["throughput_min"] for p in pts],
                [p["throughput_max"] - p["throughput_tok_s"] for p in pts],
            ]
            ax.errorbar([p["rate_rps"] for p in pts], mid, yerr=spread, marker="o", capsize=3, label=mode)
        ax.set(
            xlabel="arrival rate (req/s)",
            ylabel="committed tokens/s (median, range)",
            title="throughput under load",
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_rate.png", dpi=110)
        plt.close(fig)
        names.append("throughput_vs_rate.png")

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for g in (4, 8):
        runs = [r for r in data["runs"] if r["mode"] == fixed(g).name and r["temperature"] == 0]
        app = [
            sum(r["accepted_per_position"][i] if i < len(r["accepted_per_position"]) else 0 for r in runs)
            for i in range(g)
        ]
        rounds = sum(r["rounds"] for r in runs)
        if not rounds:
            continue
        reach = [rounds, *app]  # rounds with at least k accepted, k = 0..g
        hist = [(reach[k] - (reach[k + 1] if k + 1 <= g else 0)) / rounds for k in range(g + 1)]
        ax.bar([k + (0.2 if g == 8 else -0.2) for k in range(g + 1)], hist, width=0.4, label=f"gamma={g}")
    ax.set(
        xlabel="draft tokens accepted in a round",
        ylabel="fraction of rounds",
        title="accepted length (greedy, all prompts)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accepted_length_hist.png", dpi=110)
    plt.close(fig)
    names.append("accepted_length_hist.png")

    rows = bound_rows(data)
    if rows:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for key in dict.fromkeys(r["key"] for r in rows):
            sel = [r for r in rows if r["key"] == key]
            line = ax.plot(
                [r["gamma"] for r in sel], [r["measured"] for r in sel], marker="o", label=f"{key} measured"
            )
            ax.plot(
                [r["gamma"] for r in sel],
                [r["predicted"] for r in sel],
                ls="--",
                color=line[0].get_color(),
                label=f"{key} cost model",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="gamma", ylabel="speedup over HF target-only", title="speedup vs gamma")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "speedup_vs_gamma.png", dpi=110)
        plt.close(fig)
        names.append("speedup_vs_gamma.png")
    return names


def _attention_sentence(data: dict) -> str:
    """Which attention the target's passes ran (a record without the field ran SDPA)."""
    from specserve.engine import attention

    if data.get("attention") != attention.ATTENTION:
        return ""
    return (
        " Attention: a pass over several positions reads the grouped key/value heads in place "
        "(`specserve/engine/attention.py`, the same bits as transformers' SDPA without its copy of the cache), in "
        "the service and the HF baselines alike."
    )


def _kernels_line(data: dict) -> str:
    """Which linear kernels the target ran on (specserve/engine/cpu_kernels.py), in the service and the baselines."""
    if data.get("kernels") != "onednn":
        return "Target kernels: PyTorch's stock linear kernels, in the service and in the HF baselines."
    return (
        "Target kernels: linear layers with weights prepacked for oneDNN (`specserve/engine/cpu_kernels.py`, the "
        "target service's default on a CPU), in the service and in every HF baseline alike, so that ratios "
        "compare like with like; the row `hf target-only (stock kernels)` is HF `generate()` with PyTorch's "
        "stock kernels, what the packed path gains on its own."
    )


def _decode_steps_line(data: dict) -> list[str]:
    """The coordinator's decode_steps in the run (a report from before it existed says nothing)."""
    steps = data.get("decode_steps")
    if steps is None:
        return []
    return [
        f"Rounds without a proposal (gamma = 0, and the adaptive policy's refusals) ask the target for {steps} "
        "steps per Verify call after the first token (the coordinator's `decode_steps`); each step commits "
        "what a one-step round would.",
        "",
    ]


def write_report(data: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    load_file = out / "load.json"
    if load_file.exists():  # a later `bench load` run: its points replace the full run's, with its command
        load_run = json.loads(load_file.read_text())
        data = {**data, "load": load_run["load"], "load_run": load_run}
    plots = _plots(data, out)
    c = data["costs"]
    passes = data.get("settings", {}).get("single_repeats", 1)  # --single-repeats (absent in older runs)
    lines = [
        "# specserve benchmark report",
        "",
        f"Measured {data['date_utc']} UTC on {data['machine']['platform']} "
        f"({data['machine']['cpus']} torch threads, torch {data['machine']['torch']}, "
        f"Python {data['machine']['python']}); all figures from one run of:",
        "",
        *md.command_block(data["command"]),
        f"Models: target `{data['models']['target']}`, draft `{data['models']['draft']}`, float32. "
        f"Held-out prompts: {'yes' if data['heldout_prompts'] else 'NO (list missing)'} "
        f"(sets: {', '.join(sorted({k.split(' T=')[0] for k in data['single_stream']}))}). "
        f"Every generation runs {data['settings']['max_new_tokens']} tokens (EOS ignored) so all modes do the same work. "
        "specserve runs as one process per role (`specserve up`'s stack); the HF baselines run in the "
        "benchmark's own process while the stack idles.",
        "",
        _kernels_line(data) + _attention_sentence(data),
        "",
        *_decode_steps_line(data),
        "## Targets",
        "",
        *md.table(("target", "met", "figures"), ((n, "yes" if ok else "**missed**", f) for n, ok, f in targets(data))),
    ]
    gi = data["greedy_identity"]
    stock_note = (
        f", and {gi['identical_to_stock_kernels']} of {gi['total']} to HF target-only with PyTorch's stock kernels"
        if "identical_to_stock_kernels" in gi
        else ""
    )
    lines += [
        "",
        f"Greedy exactness check in the same run: {gi['identical']} of {gi['total']} greedy specserve generations "
        f"were token-identical to HF target-only `generate()`{stock_note}.",
        "",
        "## Model costs",
        "",
        f"Target decode step {c['target_step_ms']:.2f} ms, draft step {c['draft_step_ms']:.2f} ms "
        f"(ratio {c['target_step_ms'] / c['draft_step_ms']:.1f}); one target pass over k positions: "
        + ", ".join(f"k={k + 1}: {v:.2f} ms" for k, v in enumerate(c["verify_ms"]))
        + "."
        + _draft_as_run_line(c),
        "",
        "## Single stream (ms per committed token: median [q1, q3] over prompts"
        + (
            f" and {passes} passes over them, every other pass with the modes in the reverse order)"
            if passes > 1
            else ")"
        ),
        "",
    ]
    for key, group in data["single_stream"].items():
        hf = group.get(HF_TARGET, {}).get("ms_per_token_median")
        g0 = group.get(BASE, {}).get("ms_per_token_median")
        rows = []
        for mode, m in group.items():
            med = m["ms_per_token_median"]
            acc = f"{m['acceptance']:.2f}" if m.get("acceptance") is not None else "-"
            tpr = f"{m['tokens_per_round']:.2f}" if m.get("tokens_per_round") else "-"
            spread = f"{med:.2f} [{m['ms_per_token_q1']:.2f}, {m['ms_per_token_q3']:.2f}]"
            rows.append((mode, spread, f"{hf / med:.2f}x", f"{g0 / med:.2f}x", acc, tpr))
        header = ("mode", "ms/token", "vs HF target-only", f"vs {BASE}", "acceptance", "tokens/round")
        lines += [f"### {key}", "", *md.table(header, rows), ""]
    lines += head_table(
        "The modes that drafted with the feature head: wire cost and projections",
        ("set", "mode"),
        single_head_rows(data["single_stream"]),
        data.get("head"),
    )
    rows = bound_rows(data)
    if rows:
        as_run = all("predicted_as_run" in r for r in rows)
        lines += [
            "## The bound: cost-model prediction vs measurement",
            "",
            "Predicted speedup = E[tokens per round](alpha, gamma) x target step / (gamma x draft step + "
            "target pass over gamma + 1 positions), with alpha fitted to each gamma's measured accepted "
            "tokens per round. Efficiency = measured / predicted (network, gRPC, Redis and Python overheads "
            "are what it leaves out). The last column is a **projection, not a measurement**: the same "
            "bound with the same alpha and draft/target cost ratio, but the verify cost of an accelerator "
            "with spare parallelism (a pass over k positions at "
            + ", ".join(f"{r:g}x" for r in GPU_LIKE_VERIFY[1:])
            + " a step for k = 2..9) instead of this CPU's measured one."
            + (
                " 'Draft as run': the same bound with the draft step timed right after a target pass, on "
                "the stack's draft thread count (Model costs), the draft's cost in any speculative round on "
                "this machine; the efficiency against it is what the service's own overhead leaves (the "
                "targets are judged against the first bound)."
                if as_run
                else ""
            ),
            "",
        ]
        header = ["prompts", "gamma", "alpha", "predicted", "measured", "efficiency", "projected, GPU-like verify"]
        header += ["predicted, draft as run", "efficiency vs it"] if as_run else []
        cells = [
            [r["key"], r["gamma"], f"{r['alpha']:.2f}", f"{r['predicted']:.2f}x", f"{r['measured']:.2f}x",
             f"{r['efficiency']:.0%}", f"{r['gpu_projection']:.2f}x"]
            + ([f"{r['predicted_as_run']:.2f}x", f"{r['efficiency_as_run']:.0%}"] if as_run else [])
            for r in rows
        ]  # fmt: skip
        lines += [*md.table(header, cells), ""]
        lines += round_parts_section(rows)
    if data["load"]:
        lines += load_section(data.get("load_run") or data)
    for latency_file in latency_files(out):
        lines += latency_section(json.loads(latency_file.read_text()))
    lines += ["## Plots", ""] + [f"![{n}]({n})" for n in plots] + [""]
    lines += other_reports(out)
    return md.write(out, "README", lines)


def other_reports(out: Path) -> list[str]:
    """A section linking the reports beside this one in ``out`` (every ``*.md`` but README.md), each by its
    first heading."""
    found = []
    for path in sorted(out.glob("*.md")):
        if path.name == "README.md":
            continue
        heading = next((line[2:].strip() for line in path.read_text().splitlines() if line.startswith("# ")), path.stem)
        found.append(f"- [{path.name}]({path.name}): {heading}")
    return ["## Other reports", "", *found, ""] if found else []


def _load_settings(settings: dict) -> tuple[int, float]:
    """A load sweep's tokens per request and seconds per point: ``bench all``'s ``load_*`` settings, or
    ``bench load``'s own."""
    if "load_max_new_tokens" in settings:
        return settings["load_max_new_tokens"], settings["load_duration_s"]
    return settings["max_new_tokens"], settings["duration_s"]


def load_section(run: dict) -> list[str]:
    """The load sweep of ``run`` (``bench.json``, or ``load.json`` from ``bench load``) as Markdown lines:
    medians per (rate, mode), then adaptive over gamma 0 within each repeat."""
    tokens, seconds = _load_settings(run["settings"])
    rows = load_rows(run["load"])
    repeats = max((r["repeats"] for r in rows), default=1)
    lines = [
        "## Under load (open-loop Poisson arrivals, greedy, "
        f"{tokens} tokens per request, {seconds:g} s per point)",
        "",
    ]
    if run.get("prompt_set"):  # a run of its own (`bench load`)
        lines += [
            f"Measured {run['date_utc']} UTC, separately from the rest of this report, by:",
            "",
            *md.command_block(run["command"]),
            f"Prompts: the held-out `{run['prompt_set']}` set, the same arrival schedule for every mode.",
            "",
            *([line, ""] if (line := md.load_line(run)) else []),
        ]
    lines += [
        f"Each point measured {repeats} time(s), interleaved (every repeat sweeps the rates, and at each rate "
        "runs the modes in a rotated order); figures are medians over the repeats, tok/s with its range.",
        "",
    ]
    header = ("rate req/s", "mode", "done/sent", "errors", "tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms",
              "queue p50 ms", "target passes", "target positions", "proposed", "accepted", "wasted")  # fmt: skip
    cells = []
    for p in rows:
        spread = f" ({p['throughput_min']:.1f}-{p['throughput_max']:.1f})" if p["repeats"] > 1 else ""
        cells.append(
            (f"{p['rate_rps']:g}", p["mode"], f"{p['completed']}/{p['requests']}", p["errors"],
             f"{p['throughput_tok_s']:.1f}{spread}", f"{1000 * p['ttft_p50_s']:.0f}/{1000 * p['ttft_p99_s']:.0f}",
             f"{1000 * p['itl_p50_s']:.1f}/{1000 * p['itl_p99_s']:.1f}", f"{1000 * p['queue_p50_s']:.1f}",
             *(f"{p[k]:.0f}" for k in ("target_forward_passes", "target_positions", "proposed_tokens",
                                       "accepted_tokens", "wasted_tokens")))
        )  # fmt: skip
    lines += md.table(header, cells)
    ratios = load_ratios(run["load"])
    controls = load_ratios(run["load"], LOAD_CONTROL.name)
    if ratios:
        lines += [
            "",
            "Adaptive throughput over gamma = 0's, each repeat's pair measured side by side"
            + (
                "; beside it gamma = 0 measured twice, the A/A control: what the machine's noise alone does "
                "to such a ratio:"
                if controls
                else ":"
            ),
            "",
        ]

        def spread(rs: list[float] | None) -> list[str]:
            return [", ".join(f"{r:.2f}" for r in rs), f"{statistics.median(rs):.2f}"] if rs else ["", ""]

        header = ["rate req/s", "adaptive / gamma 0, per repeat", "median"]
        header += ["gamma 0 / gamma 0, per repeat", "median"] if controls else []
        cells = [
            [f"{rate:g}", *spread(rs), *(spread(controls.get(rate)) if controls else [])]
            for rate, rs in ratios.items()
        ]
        lines += md.table(header, cells)
    lines.append("")
    lines += head_table(
        "The feature head under load: its wire cost per point, summed over the repeats, and projections",
        ("rate req/s", "mode"),
        [((f"{rate:g}", mode), f) for (rate, mode), f in load_head_figures(run).items()],
        run.get("head"),
    )
    return lines


def load_head_figures(run: dict) -> dict[tuple[float, str], dict]:
    """Per (rate, mode) whose points relayed features, the head figures over its repeats."""
    groups: dict[tuple[float, str], list[dict]] = {}
    for p in run["load"]:
        if p.get("feature_bytes_to_draft"):  # the points that relayed features (none before the head)
            groups.setdefault((p["rate_rps"], p["mode"]), []).append(p)
    out = {}
    for key, pts in groups.items():
        f = head_projection.figures(
            run.get("head"),
            committed=sum(p["committed_tokens"] for p in pts),
            to_draft_bytes=sum(p.get("feature_bytes_to_draft", 0) for p in pts),
            from_target_bytes=sum(p.get("feature_bytes_from_target", 0) for p in pts),
            proposed=sum(p["proposed_tokens"] for p in pts),
            accepted=sum(p["accepted_tokens"] for p in pts),
            draft_rounds=sum(p.get("draft_rounds", 0) for p in pts),
        )
        if f is not None:
            out[key] = f
    return out


def head_table(title: str, keys: tuple[str, ...], rows: list[tuple[tuple, dict]], head: dict | None) -> list[str]:
    """A table of head figures (:mod:`specserve.bench.head_projection`) under ``title``, each row its key cells
    then the figures, and the note saying which are projections; nothing without rows."""
    if not rows:
        return []
    return [
        f"{title} (head `{Path(head['head']).name if head else '?'}`):",
        "",
        *md.table((*keys, *head_projection.HEADER), [(*k, *head_projection.cells(f)) for k, f in rows]),
        "",
        head_projection.note((head or {}).get("head_over_target_step")),
        "",
    ]


def single_head_rows(single_stream: dict) -> list[tuple[tuple, dict]]:
    """The single-stream (set, mode) rows with head figures (the modes that drafted with the head)."""
    return [((key, mode), row["head"]) for key, group in single_stream.items() for mode, row in group.items()
            if row.get("head")]  # fmt: skip


def write_load(run: dict, out: Path, name: str = "load") -> Path:
    """A load run's section alone (``bench load``), as ``<out>/<name>.md`` (``load.json``: ``load.md``)."""
    return md.write(out, name, load_section(run))


def single_section(run: dict) -> list[str]:
    """``single.json`` (``bench single``) as Markdown lines: per prompt set and temperature, each mode's
    median ms per committed token, its acceptance, and its speed over gamma 0 through the same service and
    over HF assisted generation (each a ratio of medians over the same prompts and passes)."""
    settings = run["settings"]
    lines = [
        "## Single stream, side by side",
        "",
        f"`{run['command']}` ({run.get('date_utc', '')}; {settings['prompts']} held-out prompts per set, "
        f"{settings['max_new_tokens']} tokens, {settings.get('repeats', settings.get('single_repeats'))} interleaved passes; feature head "
        f"served: {'yes' if run.get('feature_head') else 'no'})",
        "",
        *([line, ""] if (line := md.load_line(run)) else []),
    ]
    cells = []
    for key, group in run["single_stream"].items():
        zero = group.get(BASE, {}).get("ms_per_token_median")
        assisted = group.get(HF_ASSISTED, {}).get("ms_per_token_median")
        for mode, row in group.items():
            ms = row["ms_per_token_median"]
            acc = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            vs0 = f"{zero / ms:.2f}x" if zero else ""
            vsa = f"{assisted / ms:.2f}x" if assisted else ""
            cells.append((key, mode, f"{ms:.1f}", acc, vs0, vsa))
    header = ("set", "mode", "ms/token (median)", "acceptance", "vs gamma 0", "vs HF assisted")
    lines += md.table(header, cells, align=[md.LEFT, md.LEFT, *[md.RIGHT] * 4])
    identity = run["greedy_identity"]
    reference = identity.get("reference", HF_TARGET)
    lines += ["", f"Greedy runs token-identical to {reference}: {identity['identical']} of {identity['total']}.", ""]
    lines += head_table(
        "The modes that drafted with the feature head: wire cost and projections",
        ("set", "mode"),
        single_head_rows(run["single_stream"]),
        run.get("head"),
    )
    return lines


def write_single(data: dict, out: Path) -> Path:
    """``single.json``'s section alone, as ``<out>/single.md``."""
    return md.write(out, "single", single_section(data))


def latency_files(out: Path) -> list[Path]:
    """``latency.json`` and any further latency runs kept beside it (``latency_<name>.json``, say one tier
    behind the delay with more repeats), in that order."""
    first = [out / "latency.json"] if (out / "latency.json").exists() else []
    return first + sorted(out.glob("latency_*.json"))


def write_latency(data: dict, out: Path, name: str = "latency") -> Path:
    """A latency run's section alone, as ``<out>/<name>.md`` (``latency.json``: ``latency.md``)."""
    return md.write(out, name, latency_section(data))


def main(opts: ReportOptions) -> int:
    """``specserve bench report FOLDER``: every report in FOLDER rendered again from its JSON, measuring
    nothing."""
    folder = opts.folder
    if (folder / "bench.json").exists():
        write_report(json.loads((folder / "bench.json").read_text()), folder)
    for latency_file in latency_files(folder):
        write_latency(json.loads(latency_file.read_text()), folder, latency_file.stem)
    for load_file in [*folder.glob("load.json"), *sorted(folder.glob("load_*.json"))]:  # and further runs
        write_load(json.loads(load_file.read_text()), folder, load_file.stem)
    if (folder / "single.json").exists():
        write_single(json.loads((folder / "single.json").read_text()), folder)
    return 0
