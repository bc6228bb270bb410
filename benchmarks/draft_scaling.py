"""How the draft tier scales with concurrent sessions, with draft batching on and off.

``python -m benchmarks draft-scaling``
starts a stack like ``specserve up`` (one process per role, as in a deployment,
so the draft, the target and the coordinator share no GIL) once per setting:

* **batching on**: the draft drafts up to ``--draft-batch`` sessions in one
  forward pass per step (``DraftSettings.max_batch_size``) and the coordinator
  gathers their proposals into ``ProposeBatch`` calls
  (``CoordinatorSettings.draft_max_batch_size``);
* **batching off**: both set to 1, every session drafted alone, one after
  another on the draft's model thread (the tier before batching).

For each count of concurrent sessions (1, 2, 4, 8, 16, 32 by default) it runs
that many generations at once (greedy, a fixed gamma, ``--max-new-tokens``
tokens each, EOS ignored, held-out code prompts) and reads from the
``GenerationStats`` every client gets: draft ms per round (``draft_ns /
rounds``: the Propose call as the round saw it, batching wait included),
verify ms per round (``verify_ns / rounds``) and queue ms per round; and
the throughput, committed tokens over the wall-clock time of the whole group.
The draft's batches and the proposals they held come from its ``/metrics``
(``specserve_draft_batch_size``'s count and sum). Each point is measured
``--repeats`` times after one warm-up group;
the JSON keeps every repeat, the table their medians.

Writes ``<out>/draft_scaling.json`` and renders it as ``draft_scaling.md`` with a
plot (``draft_scaling.png``); ``python -m benchmarks report`` renders them again.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.options import DraftScalingOptions
from specserve.bench import markdown as md
from specserve.bench.runner import run_mode
from specserve.bench.timing import Stopwatch, timed_stream

SESSIONS = (1, 2, 4, 8, 16, 32)


@dataclass
class ScalingRun:
    """One group of concurrent generations."""

    batching: bool
    sessions: int
    repeat: int
    wall_s: float
    tokens: int
    rounds: int
    proposed: int
    accepted: int
    draft_ms_per_round: float
    verify_ms_per_round: float
    queue_ms_per_round: float
    throughput_tok_s: float
    draft_batches: int  # batches the draft drafted (each one forward pass per draft step)
    draft_items: int  # proposals those batches held
    errors: int


async def _group(client, prompts: list[list[int]], n: int, gamma: int, max_new: int, seed: int):
    async def one(i: int):
        stream = client.stream(
            prompt_token_ids=prompts[i % len(prompts)],
            max_new_tokens=max_new,
            temperature=0.0,
            seed=seed + i,
            ignore_eos=True,
            gamma=gamma,
        )
        return (await timed_stream(stream)).stats

    with Stopwatch() as sw:
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    return sw.seconds, results


def _draft_batches(metrics_url: str) -> tuple[int, int]:
    """The draft's batches so far and the proposals they held (its batch-size histogram's count and sum)."""
    from specserve.bench.prom import scrape

    return (
        int(scrape(metrics_url, "specserve_draft_batch_size_count")),
        int(scrape(metrics_url, "specserve_draft_batch_size_sum")),
    )


def _run(
    batching: bool, n: int, repeat: int, wall_s: float, results, before: tuple[int, int], after: tuple[int, int]
) -> ScalingRun:
    stats = [r for r in results if not isinstance(r, BaseException)]
    rounds = sum(s.rounds for s in stats) or 1
    tokens = sum(s.completion_tokens for s in stats)
    return ScalingRun(
        batching=batching,
        sessions=n,
        repeat=repeat,
        wall_s=wall_s,
        tokens=tokens,
        rounds=sum(s.rounds for s in stats),
        proposed=sum(s.proposed_tokens for s in stats),
        accepted=sum(s.accepted_tokens for s in stats),
        draft_ms_per_round=sum(s.draft_ns for s in stats) / rounds / 1e6,
        verify_ms_per_round=sum(s.verify_ns for s in stats) / rounds / 1e6,
        queue_ms_per_round=sum(s.queue_ns for s in stats) / rounds / 1e6,
        throughput_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        draft_batches=after[0] - before[0],
        draft_items=after[1] - before[1],
        errors=len(results) - len(stats),
    )


async def measure(
    *,
    target: Path,
    draft: Path,
    redis_url: str,
    prompts: list[list[int]],
    sessions: tuple[int, ...] = SESSIONS,
    gamma: int = 4,
    max_new_tokens: int = 48,
    repeats: int = 1,
    draft_batch: int = 32,
    device: str = "auto",
    dtype: str = "auto",
    progress=None,
) -> list[ScalingRun]:
    """Every (batching, sessions, repeat) point; see the module docstring."""
    from specserve.client import AsyncClient
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import free_port

    runs: list[ScalingRun] = []
    most = max(sessions)
    for batching in (True, False):
        size = draft_batch if batching else 1
        metrics_port = free_port()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        stack = await start_process_stack(
            target_model=target,
            draft_model=draft,
            redis_url=redis_url,
            device=device,
            dtype=dtype,
            draft_overrides={"max_batch_size": size, "metrics_port": metrics_port},
            coordinator_overrides={
                "draft_max_batch_size": size,
                "max_batch_size": max(16, most),  # Verify batches up to every session (the target takes 32)
                "max_sessions_per_client": max(64, most),
            },
            target_overrides={"max_batch_size": max(32, most)},
        )
        try:
            async with AsyncClient(stack.address, timeout=600) as client:
                await _group(client, prompts, min(most, 4), gamma, 8, seed=0)  # warm-up
                for n in sessions:
                    for repeat in range(repeats):
                        before = await asyncio.to_thread(_draft_batches, metrics_url)
                        wall_s, results = await _group(
                            client, prompts, n, gamma, max_new_tokens, seed=1000 * n
                        )
                        after = await asyncio.to_thread(_draft_batches, metrics_url)
                        runs.append(_run(batching, n, repeat, wall_s, results, before, after))
                        if progress is not None:
                            progress()
        finally:
            await stack.stop()
    return runs


def summarize(runs: list[ScalingRun]) -> list[dict]:
    """Medians over the repeats, one row per (batching, sessions)."""
    keys = sorted({(r.batching, r.sessions) for r in runs}, key=lambda k: (not k[0], k[1]))
    rows = []
    for batching, n in keys:
        sel = [r for r in runs if (r.batching, r.sessions) == (batching, n)]

        def med(field: str, sel=sel) -> float:
            return statistics.median(getattr(r, field) for r in sel)

        rows.append(
            {
                "batching": batching,
                "sessions": n,
                "draft_ms_per_round": med("draft_ms_per_round"),
                "verify_ms_per_round": med("verify_ms_per_round"),
                "queue_ms_per_round": med("queue_ms_per_round"),
                "throughput_tok_s": med("throughput_tok_s"),
                "sessions_per_draft_batch": (
                    sum(r.draft_items for r in sel) / max(1, sum(r.draft_batches for r in sel))
                ),
                "errors": sum(r.errors for r in sel),
                "repeats": len(sel),
            }
        )
    return rows


def to_json(runs: list[ScalingRun], settings: dict) -> dict:
    return {"settings": settings, "runs": [asdict(r) for r in runs], "summary": summarize(runs)}


async def measure_for(opts: DraftScalingOptions) -> dict:
    """``python -m benchmarks draft-scaling``: every point on 8 held-out code prompts, with the run's settings."""
    from transformers import AutoTokenizer

    from specserve.bench.runner import code_prompts_for, now_utc, stack_of

    tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
    named, heldout_ok = code_prompts_for(opts, tokenizer, 8)
    sessions = tuple(opts.sessions)
    with tqdm(total=2 * len(sessions) * opts.repeats, desc="draft scaling", unit="point") as bar:
        runs = await measure(
            **stack_of(opts),
            prompts=[ids for _, ids in named],
            sessions=sessions,
            progress=bar.update,
            **opts.pick("gamma", "max_new_tokens", "repeats", "draft_batch"),
        )
    settings = {
        "command": opts.command,
        "date_utc": now_utc(),
        "platform": platform.platform(),
        "cpus": torch.get_num_threads(),
        "target": opts.target,
        "draft": opts.draft,
        "heldout_prompts": heldout_ok,
        "sessions": list(sessions),
        "gamma": opts.gamma,
        "max_new_tokens": opts.max_new_tokens,
        "repeats": opts.repeats,
        "draft_batch": opts.draft_batch,
    }
    return to_json(runs, settings)


def draft_scaling_section(scaling: dict) -> list[str]:
    """The draft-scaling table  as Markdown lines."""
    st = scaling["settings"]
    rows = {(r["batching"], r["sessions"]): r for r in scaling["summary"]}
    sessions = sorted({n for _, n in rows})
    lines = [
        f"## The draft tier under concurrent sessions (greedy, gamma {st['gamma']}, "
        f"{st['max_new_tokens']} tokens, median of {st['repeats']} run(s))",
        "",
        f"Measured {st['date_utc']} UTC through a stack of one process per role (as `specserve up`); "
        f"target `{st['target']}`, draft `{st['draft']}`. Batching on: the draft drafts up to "
        f"{st['draft_batch']} sessions per forward pass; off: each session alone. Per round, from the "
        "clients' `GenerationStats`: draft = the Propose call as the round saw it (batching wait included), "
        "verify = the Verify call.",
        "",
    ]

    def cell(batching: bool, n: int, field: str, fmt: str = "{:.1f}") -> str:
        r = rows.get((batching, n))
        return fmt.format(r[field]) if r else "-"

    header = ("sessions", "draft ms/round on", "off", "verify ms/round on", "off", "tok/s on", "off",
              "sessions per draft batch on")  # fmt: skip
    cells = [
        (n, cell(True, n, "draft_ms_per_round"), cell(False, n, "draft_ms_per_round"),
         cell(True, n, "verify_ms_per_round"), cell(False, n, "verify_ms_per_round"),
         cell(True, n, "throughput_tok_s", "{:.0f}"), cell(False, n, "throughput_tok_s", "{:.0f}"),
         cell(True, n, "sessions_per_draft_batch"))
        for n in sessions
    ]  # fmt: skip
    lines += md.table(header, cells)
    one_on, one_off = rows.get((True, 1)), rows.get((False, 1))
    lines.append("")
    for n in sessions:
        on, off = rows.get((True, n)), rows.get((False, n))
        if n == 16 and on and one_on and off:
            lines.append(
                f"At 16 sessions, draft ms per round is {on['draft_ms_per_round'] / one_on['draft_ms_per_round']:.1f}x "
                f"the single-session figure with batching (without: "
                f"{off['draft_ms_per_round'] / one_off['draft_ms_per_round']:.1f}x), and throughput is "
                f"{on['throughput_tok_s'] / off['throughput_tok_s']:.2f}x the unbatched draft's."
            )
    errors = sum(r["errors"] for r in scaling["summary"])
    if errors:
        lines.append(f"**{errors} generations failed** during the measurement (see `draft_scaling.json`).")
    lines.append("")
    return lines


def _draft_scaling_plot(scaling: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for batching, style in ((True, "-"), (False, "--")):
        rows = sorted(
            (r for r in scaling["summary"] if r["batching"] == batching), key=lambda r: r["sessions"]
        )
        if not rows:
            continue
        label = "batching on" if batching else "batching off"
        n = [r["sessions"] for r in rows]
        axes[0].plot(n, [r["draft_ms_per_round"] for r in rows], style, marker="o", label=f"draft, {label}")
        axes[0].plot(n, [r["verify_ms_per_round"] for r in rows], style, marker="s", label=f"verify, {label}")
        axes[1].plot(n, [r["throughput_tok_s"] for r in rows], style, marker="o", label=label)
    axes[0].set(
        xscale="log", xlabel="concurrent sessions", ylabel="ms per round", title="draft and verify per round"
    )
    axes[1].set(xscale="log", xlabel="concurrent sessions", ylabel="committed tokens/s", title="throughput")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "draft_scaling.png", dpi=110)
    plt.close(fig)
    return "draft_scaling.png"


def write_draft_scaling(scaling: dict, out: Path) -> Path:
    """``draft_scaling.json``'s section alone, with its plot, as ``<out>/draft_scaling.md``."""
    out.mkdir(parents=True, exist_ok=True)
    plot = _draft_scaling_plot(scaling, out)
    return md.write(out, "draft_scaling", [*draft_scaling_section(scaling), f"![{plot}]({plot})", ""])


def main(opts: DraftScalingOptions) -> int:
    """``python -m benchmarks draft-scaling``: ``draft_scaling.json``, ``.md`` and ``.png``."""
    return run_mode(opts, measure_for, "draft_scaling", write_draft_scaling)
