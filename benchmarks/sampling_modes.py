"""Coupled against optimal sampling: what the drafter-invariant mode costs, measured through the service.

``python -m benchmarks sampling-modes`` runs, on held-out prompt sets, every prompt at each temperature
(default 0.7 and 1.0) and gamma setting (default adaptive and 4) in both
sampling modes, back to back with the same seed (the order alternating from
prompt to prompt, so drift on a shared machine hits both modes alike), through
the whole gRPC path of one local stack. It reports per prompt set, temperature
and gamma, for each mode: draft-token acceptance, tokens per round, ms per
committed token (median over prompts) and tokens/s (all tokens over all time);
and the throughput coupled mode loses against optimal.

It also checks the coupled mode's promise live: for each prompt and
temperature, the coupled outputs under every gamma setting must be identical
(``coupled_identical``).

**Choosing the default** (the rule the issue set): ``optimal`` stays the
default unless the coupled mode loses less than :data:`THROUGHPUT_LOSS_LIMIT`
(5%) of throughput under the adaptive policy (the service's default gamma)
at every measured temperature, over all prompt sets together. The verdict is
in the JSON (``verdict``) and the report; the default itself is
``specserve.api.params.DEFAULT_SAMPLING_MODE``, changed by hand when a run on the
production pair says so.

Prompt sets: ``chat`` and ``chat-code`` are the held-out chat and code
conversations of :mod:`specserve.prompts.chat` (first turn, the tokenizer's chat
template applied), for a chat pair such as the default SmolLM2 pair; ``code``
and ``prose`` are the held-out standard-library cuts of :mod:`specserve.bench.prompts`
(the embedded demo pair). The default is ``chat chat-code`` when the target's
tokenizer has a chat template, else ``code prose``.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.options import SAMPLING_GAMMAS, SAMPLING_TEMPERATURES, SamplingModesOptions
from specserve.bench import markdown as md
from specserve.bench.prompts import default_prompt_sets, load_prompt_sets
from specserve.bench.timing import timed_stream

OPTIMAL, COUPLED = "optimal", "coupled"
MODES = (OPTIMAL, COUPLED)
#: Coupled mode may become the default only if it loses less than this share of throughput.
THROUGHPUT_LOSS_LIMIT = 0.05


@dataclass
class ModeRun:
    """One generation in one sampling mode: which (prompt set, prompt, temperature, gamma setting), and what
    the client saw (tokens, seconds) and the server counted (proposed, accepted, rounds)."""

    set: str
    prompt: str
    temperature: float
    gamma: str
    mode: str
    tokens: int
    total_s: float
    proposed: int
    accepted: int
    rounds: int
    token_ids: list[int]

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.total_s / max(self.tokens, 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ms_per_token": self.ms_per_token}


async def measure(
    client,
    prompt_sets: dict[str, list[tuple[str, list[int]]]],
    *,
    temperatures=SAMPLING_TEMPERATURES,
    gammas=SAMPLING_GAMMAS,
    max_new: int,
    seed: int,
    progress=None,
) -> list[ModeRun]:
    """Every (set, prompt, temperature, gamma) in both modes, same seed, alternating order."""
    runs: list[ModeRun] = []
    jobs = [
        (set_name, index, name, ids, t, str(g))
        for set_name, prompts in prompt_sets.items()
        for index, (name, ids) in enumerate(prompts)
        for t in temperatures
        for g in gammas
    ]
    for set_name, index, name, ids, temperature, gamma in jobs:
        for mode in MODES if index % 2 == 0 else MODES[::-1]:
            stream = client.stream(
                prompt_token_ids=ids,
                max_new_tokens=max_new,
                temperature=temperature,
                seed=seed + index,
                ignore_eos=True,
                gamma=None if gamma == "auto" else int(gamma),
                sampling_mode=mode,
            )
            run = await timed_stream(stream)
            s = run.stats
            runs.append(
                ModeRun(set_name, name, temperature, gamma, mode, len(run.token_ids), run.seconds,
                        s.proposed_tokens, s.accepted_tokens, s.rounds, run.token_ids)
            )  # fmt: skip
            if progress is not None:
                progress()
    return runs


def _group(runs: list[ModeRun]) -> dict[str, Any]:
    proposed = sum(r.proposed for r in runs)
    rounds = sum(r.rounds for r in runs)
    total_s = sum(r.total_s for r in runs)
    tokens = sum(r.tokens for r in runs)
    return {
        "n": len(runs),
        "acceptance": sum(r.accepted for r in runs) / proposed if proposed else None,
        "tokens_per_round": tokens / rounds if rounds else None,
        "ms_per_token_median": statistics.median(r.ms_per_token for r in runs),
        "tokens_per_s": tokens / total_s if total_s else 0.0,
    }


def summarize(runs: list[ModeRun]) -> dict[str, Any]:
    """Per (set, temperature, gamma) and over all sets per (temperature, gamma): each mode's figures,
    coupled's throughput relative to optimal; the live invariance check; the verdict on the default."""
    by_key: dict[str, Any] = {}
    keys = dict.fromkeys((r.set, r.temperature, r.gamma) for r in runs)
    for set_name, t, g in [*keys, *dict.fromkeys(("all", r.temperature, r.gamma) for r in runs)]:
        sel = [r for r in runs if (set_name == "all" or r.set == set_name) and (r.temperature, r.gamma) == (t, g)]
        group = {mode: _group([r for r in sel if r.mode == mode]) for mode in MODES}
        opt, cpl = group[OPTIMAL]["tokens_per_s"], group[COUPLED]["tokens_per_s"]
        group["coupled_throughput_vs_optimal"] = cpl / opt if opt else None
        by_key[f"{set_name} T={t:g} gamma={g}"] = group
    identical = total = 0
    for _key, sel in itertools.groupby(
        sorted((r for r in runs if r.mode == COUPLED), key=lambda r: (r.set, r.prompt, r.temperature)),
        key=lambda r: (r.set, r.prompt, r.temperature),
    ):
        outputs = [tuple(r.token_ids) for r in sel]
        total += 1
        identical += len(set(outputs)) == 1
    return {
        "groups": by_key,
        "coupled_identical": {"identical": identical, "total": total},
        "verdict": verdict(by_key),
    }


def verdict(groups: dict[str, Any]) -> dict[str, Any]:
    """The default by the rule of the module docstring, with the losses it rests on."""
    basis = [k for k in groups if k.startswith("all ") and k.endswith("gamma=auto")]
    if not basis:  # adaptive not measured: judge on every gamma measured
        basis = [k for k in groups if k.startswith("all ")]
    losses = {
        k: 1.0 - groups[k]["coupled_throughput_vs_optimal"]
        for k in basis
        if groups[k]["coupled_throughput_vs_optimal"]
    }
    worst = max(losses.values()) if losses else None
    default = COUPLED if worst is not None and worst < THROUGHPUT_LOSS_LIMIT else OPTIMAL
    return {"losses": losses, "worst_loss": worst, "limit": THROUGHPUT_LOSS_LIMIT, "default": default}


def section(data: dict[str, Any]) -> list[str]:
    """The report's Markdown section for ``data`` (what :func:`summarize` returned, plus settings)."""
    groups, ident, v = data["groups"], data["coupled_identical"], data["verdict"]
    lines = [
        "## Sampling modes: coupled against optimal",
        "",
        "Each prompt at each temperature and gamma in both modes, same seed, back to back "
        f"({data['max_new_tokens']} tokens per generation, EOS ignored). Acceptance = accepted / proposed "
        "draft tokens; tokens/s = all committed tokens over all wall time; coupled/optimal = the ratio of "
        "their tokens/s.",
        "",
    ]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    cells = []
    for key, g in groups.items():
        set_name, t, gamma = key.split(" ")
        o, c = g[OPTIMAL], g[COUPLED]
        cells.append(
            (set_name, t[2:], gamma[6:], f"{fmt(o['acceptance'], '.2f')} / {fmt(c['acceptance'], '.2f')}",
             f"{fmt(o['tokens_per_round'], '.2f')} / {fmt(c['tokens_per_round'], '.2f')}",
             f"{o['ms_per_token_median']:.2f} / {c['ms_per_token_median']:.2f}",
             fmt(g["coupled_throughput_vs_optimal"], ".3f"))
        )  # fmt: skip
    header = ("prompts", "temperature", "gamma", "acceptance optimal / coupled", "tokens/round optimal / coupled",
              "ms/token optimal / coupled", "coupled/optimal throughput")  # fmt: skip
    lines += md.table(header, cells)
    worst = "-" if v["worst_loss"] is None else f"{100 * v['worst_loss']:.1f}%"
    lines += [
        "",
        f"Drafter invariance, checked live: {ident['identical']} of {ident['total']} (prompt, temperature) "
        "pairs gave the same coupled output under every gamma setting.",
        "",
        f"**Default: `{v['default']}`.** Rule: coupled becomes the default only if it loses less than "
        f"{100 * v['limit']:.0f}% of throughput with the adaptive policy at every temperature, all prompt "
        f"sets together; the worst loss measured here is {worst}. The default lives in "
        "`specserve/api/params.py` (`DEFAULT_SAMPLING_MODE`).",
        "",
    ]
    return lines


async def run_phase(client, tokenizer, opts: SamplingModesOptions) -> dict[str, Any]:
    """The comparison through ``client``: summary, settings and runs."""
    names = opts.prompt_sets or default_prompt_sets(tokenizer)
    sets = load_prompt_sets(names, tokenizer, opts.target, opts.prompts, opts.prompt_chars)
    total = sum(len(p) for p in sets.values()) * len(opts.temperatures) * len(opts.gammas) * len(MODES)
    bar = tqdm(total=total, desc="sampling modes", unit="gen")
    runs = await measure(
        client,
        sets,
        max_new=opts.max_new_tokens,
        progress=bar.update,
        **opts.pick("temperatures", "gammas", "seed"),
    )
    bar.close()
    return {
        **summarize(runs),
        "prompt_sets": {name: [n for n, _ in prompts] for name, prompts in sets.items()},
        "temperatures": list(opts.temperatures),
        "gammas": list(opts.gammas),
        "max_new_tokens": opts.max_new_tokens,
        "runs": [r.to_json() for r in runs],
    }


async def measure_alone(opts: SamplingModesOptions) -> dict[str, Any]:
    """``python -m benchmarks sampling-modes``: one local stack, no models loaded in this process."""
    from transformers import AutoTokenizer

    from specserve.bench.runner import Machine, now_utc
    from specserve.client import AsyncClient
    from specserve.launch.local import start_local_stack

    tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
    stack = await start_local_stack(target_model=opts.target, draft_model=opts.draft, redis_url=opts.redis_url)
    try:
        async with AsyncClient(stack.address, timeout=600) as client:
            for mode in MODES:  # warm-up
                await client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4, seed=0, sampling_mode=mode)
            modes = await run_phase(client, tokenizer, opts)
    finally:
        await stack.stop()
    return {
        "command": opts.command,
        "machine": asdict(Machine.here()),
        "date_utc": now_utc(),
        "models": {"target": opts.target, "draft": opts.draft},
        "sampling_modes": modes,
    }


def write(data: dict[str, Any], out: Path) -> Path:
    """``<out>/sampling_modes.md`` of a ``python -m benchmarks sampling-modes`` run (its JSON beside it)."""
    header = [
        "# specserve: sampling modes",
        "",
        f"Measured {data['date_utc']} UTC on {data['machine']['platform']} "
        f"({data['machine']['cpus']} torch threads, torch {data['machine']['torch']}); "
        f"target `{data['models']['target']}`, draft `{data['models']['draft']}`; one run of:",
        "",
        *md.command_block(data["command"]),
    ]
    return md.write(out, "sampling_modes", header + section(data["sampling_modes"]))


def main(opts: SamplingModesOptions) -> int:
    """``python -m benchmarks sampling-modes``: ``sampling_modes.json`` and ``sampling_modes.md``."""
    from specserve.bench.runner import run_mode

    return run_mode(opts, measure_alone, "sampling_modes", write)
