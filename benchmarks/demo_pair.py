"""Measure the embedded default draft/target pair on held-out stdlib code.

Run::

    python -m benchmarks demo-pair --target models/specserve-demo-target --draft models/specserve-demo-draft

Everything runs in float32, batch 1, on the CPU (``--threads``, default 2). It
measures, on the held-out files named in ``<target>/heldout_files.json``:

(a) **greedy acceptance at gamma** (default 4): in-process speculative greedy
    decoding from held-out prompts (the draft proposes ``gamma`` greedy tokens,
    the target checks them in one pass and accepts the prefix that equals its
    own argmax); ``accepted / proposed`` over all rounds. The output is checked
    to be token-identical to target-only greedy decoding.
(b) **alpha at temperature 1**: mean over positions of ``sum_x min(p(x), q(x))``
    with teacher forcing on held-out windows (``p`` target, ``q`` draft).
(c) **greedy agreement**: mean over the same positions of
    ``argmax p == argmax q``.
(d) **costs**: one target decode step and one draft decode step with a warm KV
    cache (interleaved, medians after warm-up), their ratio, and one target pass
    over ``gamma + 1`` positions (verification) relative to one target step.
    Also the wall-clock speedup of (a) over a target-only greedy loop.

It prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sysconfig
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.options import DemoPairOptions
from specserve.bench.pair import forward as _fwd
from specserve.bench.pair import load_pair
from specserve.bench.prompts import heldout_files
from specserve.bench.timing import Laps, Stopwatch


def heldout_texts(model_dir: str | Path) -> list[tuple[str, str]]:
    """``(path relative to the stdlib, text)`` of the held-out stdlib files of this pair."""
    files, listed = heldout_files(Path(model_dir))
    if not listed:
        raise FileNotFoundError(f"none of the held-out files of {model_dir} exist under the stdlib")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(str(p.relative_to(stdlib)), p.read_text(encoding="utf-8")) for p in files]


# --------------------------------------------------------------------------- decoding


@torch.inference_mode()
def speculative_greedy(
    target, draft, prompt: list[int], max_new: int, gamma: int = 4, eos_id: int | None = None
) -> tuple[list[int], dict]:
    """Greedy speculative decoding in-process, both models with KV caches.

    Returns the new tokens (identical to target-only greedy decoding up to
    floating-point ties) and ``{"proposed", "accepted", "rounds"}``.
    Invariant after each round: the target cache holds ``seq[:-1]`` (the last
    committed token is pending) and the draft cache a prefix of ``seq``.
    """
    seq = list(prompt)
    tc, dc = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    if len(seq) > 1:
        _fwd(target, seq[:-1], tc)
    t_len, d_len = len(seq) - 1, 0
    new: list[int] = []
    proposed = accepted = rounds = 0
    while len(new) < max_new:
        g = min(gamma, max_new - len(new) - 1)
        props: list[int] = []
        if g > 0:
            logits = _fwd(draft, seq[d_len:], dc)[-1]
            d_len = len(seq)
            for i in range(g):
                props.append(int(logits.argmax()))
                if i < g - 1:
                    logits = _fwd(draft, props[-1:], dc)[-1]
                    d_len += 1
        logits = _fwd(target, seq[t_len:] + props, tc)
        best = logits[-(g + 1) :].argmax(-1).tolist()
        k = 0
        while k < g and props[k] == best[k]:
            k += 1
        out = [*props[:k], best[k]]
        if g - k > 0:
            tc.crop(-(g - k))
        t_len = len(seq) + k
        keep = min(d_len, len(seq) + k)
        if d_len > keep:
            dc.crop(-(d_len - keep))
            d_len = keep
        assert tc.get_seq_length() == t_len and dc.get_seq_length() == d_len
        proposed += g
        accepted += k
        rounds += 1
        seq += out
        new += out
        if eos_id is not None and eos_id in out:
            new = new[: len(new) - len(out) + out.index(eos_id) + 1]
            break
    return new[:max_new], {"proposed": proposed, "accepted": accepted, "rounds": rounds}


@torch.inference_mode()
def target_greedy(target, prompt: list[int], max_new: int, eos_id: int | None = None) -> list[int]:
    """Target-only greedy decoding with a KV cache (one token per step)."""
    cache = DynamicCache(config=target.config)
    logits = _fwd(target, prompt, cache)[-1]
    new: list[int] = []
    while len(new) < max_new:
        x = int(logits.argmax())
        new.append(x)
        if x == eos_id:
            break
        logits = _fwd(target, [x], cache)[-1]
    return new


# --------------------------------------------------------------------------- measurements


def prompts_from(texts, tok, n: int, prompt_len: int, max_new: int) -> list[tuple[str, list[int]]]:
    """One prompt per held-out file (the first ``n`` files long enough): the
    ``prompt_len`` tokens starting at the middle of the file."""
    out = []
    for rel, text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < prompt_len + max_new:
            continue
        mid = (len(ids) - prompt_len) // 2
        out.append((rel, ids[mid : mid + prompt_len]))
        if len(out) == n:
            break
    return out


@torch.inference_mode()
def teacher_forced(target, draft, texts, tok, n_windows: int, seq_len: int) -> dict:
    eos = tok.eos_token_id
    stream: list[int] = []
    for _, text in texts:
        stream += [eos] + tok(text, add_special_tokens=False)["input_ids"]
    s = torch.tensor(stream)
    hi = len(s) - seq_len - 1
    starts = torch.linspace(0, hi, n_windows).long()
    alpha_sum = agree = n = 0.0
    ce_t = ce_d = 0.0
    for st in starts.tolist():
        w = s[st : st + seq_len + 1][None]
        lp = torch.log_softmax(target(input_ids=w[:, :-1]).logits[0].float(), -1)
        lq = torch.log_softmax(draft(input_ids=w[:, :-1]).logits[0].float(), -1)
        y = w[0, 1:]
        alpha_sum += torch.minimum(lp.exp(), lq.exp()).sum(-1).sum().item()
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        ce_t += -lp.gather(1, y[:, None]).sum().item()
        ce_d += -lq.gather(1, y[:, None]).sum().item()
        n += len(y)
    return {
        "alpha_T1": alpha_sum / n,
        "greedy_agreement": agree / n,
        "target_loss": ce_t / n,
        "draft_loss": ce_d / n,
        "positions": int(n),
        "windows": n_windows,
        "window_len": seq_len,
    }


@torch.inference_mode()
def step_costs(target, draft, gamma: int, context: int, steps: int, warmup: int, seed: int = 0) -> dict:
    """Medians of interleaved draft step / target step / target (gamma+1)-position
    pass timings, each with a warm KV cache of ``context`` .. ``context + steps``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, context), generator=g).tolist()[0]
    tc, dc = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    _fwd(target, ids, tc)
    _fwd(draft, ids, dc)
    tok = torch.randint(0, target.config.vocab_size, (steps + warmup, gamma + 1), generator=g).tolist()
    laps = Laps(warmup)
    for i in laps.rounds(steps):
        with laps.time("draft"):
            _fwd(draft, tok[i][:1], dc)
        with laps.time("target"):
            _fwd(target, tok[i][:1], tc)
        with laps.time("verify"):
            _fwd(target, tok[i], tc)
        tc.crop(-(gamma + 1))
    out = {
        "target_step_ms": laps.median_ms("target"),
        "draft_step_ms": laps.median_ms("draft"),
        f"target_verify_{gamma + 1}_ms": laps.median_ms("verify"),
        "steps": steps,
        "warmup": warmup,
        "context_tokens": context,
    }
    out["target_over_draft_step"] = out["target_step_ms"] / out["draft_step_ms"]
    out[f"verify_{gamma + 1}_over_target_step"] = out[f"target_verify_{gamma + 1}_ms"] / out["target_step_ms"]
    return out


def greedy_acceptance(target, draft, prompts, gamma: int, max_new: int, eos_id: int) -> dict:
    proposed = accepted = rounds = tokens = 0
    mismatches = 0
    t_spec = t_ref = 0.0
    per_prompt = []
    for rel, p in prompts:
        with Stopwatch() as ref_sw:
            ref = target_greedy(target, p, max_new, eos_id)
        with Stopwatch() as spec_sw:
            new, st = speculative_greedy(target, draft, p, max_new, gamma, eos_id)
        t_ref += ref_sw.seconds
        t_spec += spec_sw.seconds
        same = new == ref
        mismatches += not same
        proposed += st["proposed"]
        accepted += st["accepted"]
        rounds += st["rounds"]
        tokens += len(new)
        per_prompt.append(
            {
                "file": rel,
                "acceptance": st["accepted"] / max(1, st["proposed"]),
                "identical_to_target_greedy": same,
                **st,
            }
        )
    return {
        "gamma": gamma,
        "acceptance": accepted / proposed,
        "proposed": proposed,
        "accepted": accepted,
        "rounds": rounds,
        "tokens": tokens,
        "tokens_per_round": tokens / rounds,
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "outputs_identical_to_target_greedy": len(prompts) - mismatches,
        "target_only_s": t_ref,
        "speculative_s": t_spec,
        "wall_clock_speedup": t_ref / t_spec,
        "per_prompt": per_prompt,
    }


def main(args: DemoPairOptions) -> int:
    """``python -m benchmarks demo-pair``: the figures, printed and written to ``--json``."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with Stopwatch() as load_sw:
        tok, target, draft = load_pair(args.target, args.draft)
    load_s = load_sw.seconds
    texts = heldout_texts(args.target)
    prompts = prompts_from(texts, tok, args.prompts, args.prompt_len, args.max_new)

    res: dict = {
        "command": args.command,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}), "
        f"torch {torch.__version__}, {args.threads} threads, float32, batch 1",
        "cpu_load_avg_1m_at_start": os.getloadavg()[0],
        "target": str(args.target),
        "draft": str(args.draft),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "load_s": load_s,
        "heldout_files": len(texts),
        "prompt_len": args.prompt_len,
        "args": args.settings(),
    }
    res["greedy"] = greedy_acceptance(target, draft, prompts, args.gamma, args.max_new, tok.eos_token_id)
    res["teacher_forced"] = teacher_forced(target, draft, texts, tok, args.windows, args.window_len)
    res["costs"] = step_costs(target, draft, args.gamma, args.context, args.steps, args.warmup)
    res["cpu_load_avg_1m_at_end"] = os.getloadavg()[0]
    g, tf, c = res["greedy"], res["teacher_forced"], res["costs"]
    k = args.gamma + 1
    res["requirements"] = {
        "target_over_draft_step_ge_5": c["target_over_draft_step"] >= 5,
        f"greedy_acceptance_gamma{args.gamma}_ge_0.6": g["acceptance"] >= 0.6,
    }
    rows = [
        (
            f"(a) greedy acceptance, gamma={args.gamma}",
            f"{g['acceptance']:.3f}",
            f"{g['accepted']}/{g['proposed']} over {g['rounds']} rounds, {g['prompts']} prompts",
        ),
        ("    tokens per target pass", f"{g['tokens_per_round']:.2f}", ""),
        (
            "    outputs == target-only greedy",
            f"{g['outputs_identical_to_target_greedy']}/{g['prompts']}",
            "",
        ),
        (
            "    wall-clock speedup vs target-only",
            f"{g['wall_clock_speedup']:.2f}x",
            f"{g['target_only_s']:.2f}s -> {g['speculative_s']:.2f}s",
        ),
        ("(b) alpha at T=1", f"{tf['alpha_T1']:.3f}", f"{tf['positions']} teacher-forced positions"),
        ("(c) greedy agreement", f"{tf['greedy_agreement']:.3f}", ""),
        (
            "    held-out loss target / draft",
            f"{tf['target_loss']:.3f} / {tf['draft_loss']:.3f}",
            "nats/token",
        ),
        ("(d) target decode step", f"{c['target_step_ms']:.2f} ms", f"median of {c['steps']}"),
        ("    draft decode step", f"{c['draft_step_ms']:.2f} ms", ""),
        ("    target / draft step", f"{c['target_over_draft_step']:.2f}x", ""),
        (
            f"    target pass over {k} positions",
            f"{c[f'target_verify_{k}_ms']:.2f} ms",
            f"{c[f'verify_{k}_over_target_step']:.2f}x one step",
        ),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{res['date_utc']}  {res['machine']}")
    for name, val, note in rows:
        print(f"{name:<{w}}  {val:>14}  {note}")
    print("requirements:", res["requirements"])
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    print("wrote", args.json)
    return 0
