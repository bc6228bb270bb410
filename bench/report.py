"""Render ``bench.json`` (from ``bench.harness``) as a Markdown report with PNG plots.

``python -m bench.report docs/benchmarks`` re-renders without re-measuring.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.costs import Costs, expected_tokens, predicted_speedup

FIXED = (1, 2, 4, 8)


def _alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """Solve sum_{i=1..gamma} a^i = mean accepted per round for the i.i.d. acceptance a (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return lo


def bound_rows(data: dict) -> list[dict]:
    """Predicted vs measured speedup over HF target-only, per gamma, per (set, temperature)."""
    costs = Costs(**data["costs"])
    rows = []
    for key, group in data["single_stream"].items():
        base = group.get("hf target-only", {}).get("ms_per_token_median")
        set_name, temp = key.split(" T=")
        for g in FIXED:
            mode = group.get(f"specserve gamma={g}")
            runs = [
                r
                for r in data["runs"]
                if r["mode"] == f"specserve gamma={g}"
                and r["prompt_set"] == set_name
                and f"{r['temperature']:g}" == temp
            ]
            rounds = sum(r["rounds"] for r in runs)
            if not mode or not base or not rounds:
                continue
            alpha = _alpha_from_mean_accepted(sum(r["accepted"] for r in runs) / rounds, g)
            predicted = predicted_speedup(alpha, g, costs)
            measured = base / mode["ms_per_token_median"]
            rows.append(
                {
                    "key": key,
                    "gamma": g,
                    "alpha": alpha,
                    "predicted": predicted,
                    "measured": measured,
                    "efficiency": measured / predicted,
                }
            )
    return rows


def targets(data: dict) -> list[tuple[str, bool, str]]:
    """The issue's targets for the demo pair, each with its verdict and figures."""
    out = []
    ss = data["single_stream"]
    for key, group in ss.items():
        ad = group.get("specserve adaptive", {}).get("ms_per_token_median")
        hf = group.get("hf target-only", {}).get("ms_per_token_median")
        hfa = group.get("hf assisted", {}).get("ms_per_token_median")
        fixed = {
            g: group[f"specserve gamma={g}"]["ms_per_token_median"]
            for g in FIXED
            if f"specserve gamma={g}" in group
        }
        if not (ad and hf and hfa and fixed):
            continue
        if key.endswith("T=0"):
            out.append(
                (
                    f"{key}: adaptive >= 1.5x faster than HF target-only",
                    hf / ad >= 1.5,
                    f"{hf / ad:.2f}x ({hf:.2f} -> {ad:.2f} ms/token)",
                )
            )
        out.append(
            (
                f"{key}: adaptive not slower than HF assisted",
                ad <= hfa,
                f"{hfa / ad:.2f}x ({hfa:.2f} vs {ad:.2f} ms/token)",
            )
        )
        best_g = min(fixed, key=fixed.get)
        out.append(
            (
                f"{key}: adaptive within 20% of the best fixed gamma ({best_g})",
                ad <= 1.2 * fixed[best_g],
                f"{ad / fixed[best_g]:.2f}x of gamma={best_g} ({fixed[best_g]:.2f} ms/token)",
            )
        )
    by_rate: dict[float, dict[str, float]] = {}
    for p in data["load"]:
        by_rate.setdefault(p["rate_rps"], {})[p["mode"]] = p["throughput_tok_s"]
    for rate, modes in sorted(by_rate.items()):
        base = modes.get("specserve gamma=0")
        ad = modes.get("specserve adaptive")
        if base and ad:
            out.append(
                (
                    f"load {rate:g} req/s: adaptive throughput >= 95% of gamma=0",
                    ad >= 0.95 * base,
                    f"{ad:.1f} vs {base:.1f} tok/s ({ad / base:.2f})",
                )
            )
    return out


def _plots(data: dict, out: Path) -> list[str]:
    names = []
    load = data["load"]
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
            ax.plot(
                [p["rate_rps"] for p in pts], [p["throughput_tok_s"] for p in pts], marker="o", label=mode
            )
        ax.set(xlabel="arrival rate (req/s)", ylabel="committed tokens/s", title="throughput under load")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_rate.png", dpi=110)
        plt.close(fig)
        names.append("throughput_vs_rate.png")

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for g in (4, 8):
        runs = [r for r in data["runs"] if r["mode"] == f"specserve gamma={g}" and r["temperature"] == 0]
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


def write_report(data: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(data, out)
    c = data["costs"]
    lines = [
        "# specserve benchmark report",
        "",
        f"Measured {data['date_utc']} UTC on {data['machine']['platform']} "
        f"({data['machine']['cpus']} torch threads, torch {data['machine']['torch']}, "
        f"Python {data['machine']['python']}); all figures from one run of:",
        "",
        f"```\n{data['command']}\n```",
        "",
        f"Models: target `{data['models']['target']}`, draft `{data['models']['draft']}`, float32. "
        f"Prompts from held-out standard-library files: {'yes' if data['heldout_prompts'] else 'NO (list missing)'}. "
        f"Every generation runs {data['settings']['max_new_tokens']} tokens (EOS ignored) so all modes do the same work.",
        "",
        "## Targets",
        "",
        "| target | met | figures |",
        "| --- | --- | --- |",
    ]
    for name, ok, fig in targets(data):
        lines.append(f"| {name} | {'yes' if ok else '**missed**'} | {fig} |")
    gi = data["greedy_identity"]
    lines += [
        "",
        f"Greedy exactness check in the same run: {gi['identical']} of {gi['total']} greedy specserve generations "
        "were token-identical to HF target-only `generate()`.",
        "",
        "## Model costs",
        "",
        f"Target decode step {c['target_step_ms']:.2f} ms, draft step {c['draft_step_ms']:.2f} ms "
        f"(ratio {c['target_step_ms'] / c['draft_step_ms']:.1f}); one target pass over k positions: "
        + ", ".join(f"k={k + 1}: {v:.2f} ms" for k, v in enumerate(c["verify_ms"]))
        + ".",
        "",
        "## Single stream (ms per committed token: median [q1, q3] over prompts)",
        "",
    ]
    for key, group in data["single_stream"].items():
        hf = group.get("hf target-only", {}).get("ms_per_token_median")
        g0 = group.get("specserve gamma=0", {}).get("ms_per_token_median")
        lines += [
            f"### {key}",
            "",
            "| mode | ms/token | vs HF target-only | vs specserve gamma=0 | acceptance | tokens/round |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for mode, m in group.items():
            med = m["ms_per_token_median"]
            acc = f"{m['acceptance']:.2f}" if m.get("acceptance") is not None else "-"
            tpr = f"{m['tokens_per_round']:.2f}" if m.get("tokens_per_round") else "-"
            lines.append(
                f"| {mode} | {med:.2f} [{m['ms_per_token_q1']:.2f}, {m['ms_per_token_q3']:.2f}] | "
                f"{hf / med:.2f}x | {g0 / med:.2f}x | {acc} | {tpr} |"
            )
        lines.append("")
    rows = bound_rows(data)
    if rows:
        lines += [
            "## The bound: cost-model prediction vs measurement",
            "",
            "Predicted speedup = E[tokens per round](alpha, gamma) x target step / (gamma x draft step + "
            "target pass over gamma + 1 positions), with alpha fitted to each gamma's measured accepted "
            "tokens per round. Efficiency = measured / predicted (network, gRPC, Redis and Python overheads "
            "are what it leaves out).",
            "",
            "| prompts | gamma | alpha | predicted | measured | efficiency |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['key']} | {r['gamma']} | {r['alpha']:.2f} | {r['predicted']:.2f}x | "
                f"{r['measured']:.2f}x | {r['efficiency']:.0%} |"
            )
        lines.append("")
    if data["load"]:
        lines += [
            "## Under load (open-loop Poisson arrivals, greedy, "
            f"{data['settings']['load_max_new_tokens']} tokens per request, "
            f"{data['settings']['load_duration_s']:g} s per point)",
            "",
            "| rate req/s | mode | done/sent | errors | tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | queue p50 ms "
            "| target passes | target positions | accepted | wasted |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in data["load"]:
            lines.append(
                f"| {p['rate_rps']:g} | {p['mode']} | {p['completed']}/{p['requests']} | {p['errors']} | "
                f"{p['throughput_tok_s']:.1f} | {1000 * p['ttft_p50_s']:.0f}/{1000 * p['ttft_p99_s']:.0f} | "
                f"{1000 * p['itl_p50_s']:.1f}/{1000 * p['itl_p99_s']:.1f} | {1000 * p['queue_p50_s']:.1f} | "
                f"{p['target_forward_passes']} | {p['target_positions']} | {p['accepted_tokens']} | "
                f"{p['wasted_tokens']} |"
            )
        lines.append("")
    lines += ["## Plots", ""] + [f"![{n}]({n})" for n in plots] + [""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks")
    write_report(json.loads((folder / "bench.json").read_text()), folder)
