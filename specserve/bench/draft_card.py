"""The default draft's figures for its model card: acceptance per gamma and the cost ratio.

Run (the figures in ``specserve/models/specserve-smollm2-draft/README.md`` come from this)::

    specserve bench draft-card --json specserve/models/specserve-smollm2-draft/card.json

In float32 on the CPU (``--threads``, default 2), batch 1, on the held-out
prompts of :mod:`specserve.prompts.chat` (subjects never seen in training), chat
template applied:

* **Greedy acceptance per gamma** (temperature 0): the mean fraction of
  proposed draft tokens accepted, ``accepted / proposed`` over all rounds. For
  greedy decoding the committed sequence is the target's own greedy
  continuation, so each round is replayed exactly on it: from each round's start
  the draft proposes ``gamma`` tokens autoregressively (its own KV cache), the
  accepted prefix is the part equal to the target's continuation, and the next
  round starts after it plus the correction or bonus token. The target runs
  once per prompt.
* **Acceptance per gamma at temperature 0.7**: real speculative sampling with
  specserve's own sampler (``specserve.core.sampling`` processing on both sides,
  ``specserve.core.verification.verify_batch`` deciding), so the rounds, the
  rejections and the resampled tokens are the ones the service would produce
  with that seed. Fewer prompts and tokens than greedy: every round runs the
  target.
* **Cost ratio**: one target decode step over one draft decode step, both with
  a warm KV cache of ``--context`` tokens, interleaved, medians after warm-up;
  and the target's pass over ``k`` positions for ``k = 1..9`` relative to one
  step (what verification costs on this machine).
"""

from __future__ import annotations

import datetime as dt
import json
import platform

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import specserve.engine.draft_model  # noqa: F401  (registers the draft's model type)
from specserve.api.params import SamplingParams
from specserve.bench import markdown as md
from specserve.bench.options import DraftCardOptions
from specserve.bench.timing import Laps
from specserve.core.proposal import DraftProposal
from specserve.core.rng import Purpose, uniform
from specserve.core.sampling import check_distribution, logits_to_probs, sample_from
from specserve.core.verification import verify_batch
from specserve.prompts.chat import heldout_prompts

GAMMAS = (1, 2, 3, 4, 6, 8)


def _fwd(model, ids: list[int], cache: DynamicCache) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0]  # [len, vocab]


def _prompt_ids(tok, prompt) -> list[int]:
    text = tok.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def target_greedy(target, prompt: list[int], max_new: int, eos: int) -> list[int]:
    cache = DynamicCache(config=target.config)
    logits = _fwd(target, prompt, cache)[-1]
    out: list[int] = []
    while len(out) < max_new:
        x = int(logits.argmax())
        out.append(x)
        if x == eos:
            break
        logits = _fwd(target, [x], cache)[-1]
    return out


@torch.inference_mode()
def replay_greedy(draft, prompt: list[int], continuation: list[int], gamma: int) -> tuple[int, int, int]:
    """Greedy speculative rounds replayed on the target's own continuation: (proposed, accepted, rounds)."""
    cache = DynamicCache(config=draft.config)
    seq = list(prompt)
    cached = 0
    proposed = accepted = rounds = 0
    j = 0  # committed tokens of the continuation
    while j < len(continuation):
        g = min(gamma, len(continuation) - j - 1)
        if g > 0:
            if cached > len(seq) - 1:
                cache.crop(len(seq) - 1 - cached)
                cached = len(seq) - 1
            logits = _fwd(draft, seq[cached:], cache)[-1]
            cached = len(seq)
            props: list[int] = []
            for i in range(g):
                props.append(int(logits.argmax()))
                if i + 1 < g:
                    logits = _fwd(draft, props[-1:], cache)[-1]
                    cached += 1
            k = 0
            while k < g and props[k] == continuation[j + k]:
                k += 1
            keep = len(seq) + k
            if cached > keep:
                cache.crop(keep - cached)
                cached = keep
            proposed += g
            accepted += k
        else:
            k = 0
        take = continuation[j : j + k + 1]
        seq += take
        j += len(take)
        rounds += 1
    return proposed, accepted, rounds


@torch.inference_mode()
def sampled_rounds(
    target, draft, prompt: list[int], max_new: int, gamma: int, params: SamplingParams, eos: int
):
    """Real speculative sampling with specserve's sampler: (proposed, accepted, rounds, tokens)."""
    tc, dc = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    seq = list(prompt)
    _fwd(target, seq[:-1], tc)
    t_len, d_len = len(seq) - 1, 0
    proposed = accepted = rounds = 0
    new = 0
    while new < max_new:
        g = min(gamma, max_new - new - 1)
        props: list[int] = []
        rows: list[torch.Tensor] = []
        if g > 0:
            if d_len > len(seq):
                dc.crop(len(seq) - d_len)
                d_len = len(seq)
            logits = _fwd(draft, seq[d_len:], dc)[-1]
            d_len = len(seq)
            for i in range(g):
                q = check_distribution(logits_to_probs(logits[None], params, None).to(torch.float32))[0]
                x = sample_from(q, uniform(params.seed, len(seq) + i, Purpose.DRAFT))
                props.append(x)
                rows.append(q)
                if i + 1 < g:
                    logits = _fwd(draft, [x], dc)[-1]
                    d_len += 1
        logits = _fwd(target, seq[t_len:] + props, tc)[-(g + 1) :]  # [g + 1, vocab]
        p = logits_to_probs(logits, params, None)  # [g + 1, vocab] float64
        proposal = DraftProposal(tuple(props), torch.stack(rows) if rows else None)
        outcome = verify_batch(p[None], [proposal], [params.seed], [len(seq)])[0]
        out = outcome.emitted(props)
        if g > outcome.accepted:
            tc.crop(outcome.accepted - g)
        t_len = len(seq) + outcome.accepted
        if d_len > len(seq) + outcome.accepted:
            dc.crop(len(seq) + outcome.accepted - d_len)
            d_len = len(seq) + outcome.accepted
        proposed += g
        accepted += outcome.accepted
        rounds += 1
        seq += out
        new += len(out)
        if eos in out:
            break
    return proposed, accepted, rounds, new


@torch.inference_mode()
def step_costs(target, draft, *, context: int, steps: int, warmup: int, max_k: int = 9) -> dict:
    """Medians of interleaved draft step / target step / target k-position pass timings, in ms."""
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (context,), generator=g).tolist()
    tc, dc = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    _fwd(target, ids, tc)
    _fwd(draft, ids, dc)
    laps = Laps(warmup)
    ks = range(1, max_k + 1)
    for _ in laps.rounds(steps):
        toks = torch.randint(0, vocab, (max_k,), generator=g).tolist()
        with laps.time("draft"):
            _fwd(draft, toks[:1], dc)
        dc.crop(-1)
        for k in ks:
            with laps.time(str(k)):
                _fwd(target, toks[:k], tc)
            tc.crop(-k)
    target_step, draft_step = laps.median_ms("1"), laps.median_ms("draft")
    return {
        "target_step_ms": target_step,
        "draft_step_ms": draft_step,
        "target_over_draft_step": target_step / draft_step,
        "verify_k_over_target_step": {k: laps.median_ms(str(k)) / target_step for k in ks},
        "verify_k_ms": {k: laps.median_ms(str(k)) for k in ks},
        "context_tokens": context,
        "steps": steps,
    }


def run(args: DraftCardOptions) -> dict:
    from specserve.engine.models import resolve_model_path

    torch.set_num_threads(args.threads)
    target_dir = resolve_model_path(args.target, "target")
    draft_dir = resolve_model_path(args.draft, "draft")
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    result: dict = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "target": str(target_dir),
        "draft": str(draft_dir),
        "dtype": "float32",
        "command": args.command,
    }
    result["costs"] = step_costs(target, draft, context=args.context, steps=args.cost_steps, warmup=5)
    print(json.dumps(result["costs"], indent=1), flush=True)
    for kind in ("chat", "code"):
        prompts = heldout_prompts(kind, args.prompts)
        ids = [_prompt_ids(tok, p) for p in prompts]
        refs = [target_greedy(target, p, args.max_new_tokens, eos) for p in ids]
        greedy = {}
        for gamma in GAMMAS:
            tot = [0, 0, 0]
            for p, ref in zip(ids, refs, strict=True):
                for i, v in enumerate(replay_greedy(draft, p, ref, gamma)):
                    tot[i] += v
            greedy[gamma] = {"acceptance": tot[1] / max(1, tot[0]), "proposed": tot[0], "rounds": tot[2]}
        sampled = {}
        for gamma in args.sampled_gammas:
            tot = [0, 0, 0, 0]
            for n, p in enumerate(ids[: args.sampled_prompts]):
                params = SamplingParams(temperature=0.7, seed=1000 + n)
                for i, v in enumerate(
                    sampled_rounds(target, draft, p, args.sampled_tokens, gamma, params, eos)
                ):
                    tot[i] += v
            sampled[gamma] = {"acceptance": tot[1] / max(1, tot[0]), "proposed": tot[0], "rounds": tot[2]}
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
    return result


def render_card(card: dict, meta: dict, name: str = "specserve-smollm2-draft") -> str:
    """The model card (``README.md``) from this benchmark's JSON and the training metadata of
    ``scripts/distill_draft.py export`` (``training_meta.json``): every figure comes from those files."""
    args = meta["args"]
    history = meta["history"]
    first, last = history[0], history[-1]
    costs = card["costs"]
    ratio = costs["target_step_ms"] / costs["draft_step_ms"]
    chat4 = card["chat"]["greedy"]["4"]["acceptance"]
    lines = [
        f"# {name}",
        "",
        "The default draft for the target SmolLM2-135M-Instruct (`smollm2-135m-instruct`), distilled",
        "from it on a 2-core CPU machine by `scripts/distill_draft.py`. It shares the target's tokenizer",
        "and chat template. Architecture (`specserve/engine/draft_model.py`, model type `specserve_draft`): the",
        f"target's first {args['layers']} decoder layers and final norm, an output head over the",
        f"{args['head_size']:} tokens the target emits most (its logits scattered into a full-vocabulary row,",
        "`-inf` elsewhere, so `AutoModelForCausalLM` and HF assisted generation use it unchanged once",
        "`import specserve.engine.draft_model` has registered the type), and an input embedding that shares the",
        f"head's rows and maps every other token through a rank-{args['embed_rank']} table. Float16 on disk.",
        "",
        "## Training",
        "",
        f"- Data: the target's own answers ({meta['train_rows']} answers: first turns, and second turns",
        "  where the prompt has a follow-up) to training prompts of `specserve/prompts/chat.py` (everyday",
        "  questions, explanations, how-tos, short code requests), greedy for some prompts and sampled at",
        "  temperature 0.7 for the rest, in bfloat16, with the",
        f"  target's top-20 log-probabilities at every one of the {meta['train_positions']:,} generated positions.",
        "  Held-out subjects (one in eight, by a hash of the subject) never appear in training.",
        f"- Objective: KL(target || draft) over the top-20 support, plus {args['ce_weight']} x cross-entropy on",
        f"  the target's top token; AdamW, lr {args['lr']}, cosine schedule, batch {args['batch_size']},",
        f"  {meta['step']} steps ({last['time_s'] / 60:.0f} minutes on 2 cores).",
        f"- Held-out answers (greedy and T=0.7): KL {first['kl']:.2f} -> {last['kl']:.2f}, top-1 agreement",
        f"  {first['top1_agreement']:.3f} -> {last['top1_agreement']:.3f}; the head covers {meta['heldout_top1_coverage']:.1%}",
        "  of the target's held-out top-1 tokens (the cap on agreement).",
        "",
        *md.table(
            ("step", "minutes", "held-out loss", "held-out KL", "held-out top-1 agreement"),
            ((h["step"], f"{h['time_s'] / 60:.0f}", f"{h['loss']:.3f}", f"{h['kl']:.3f}", f"{h['top1_agreement']:.3f}")
             for h in history),
        ),
    ]  # fmt: skip
    lines += [
        "",
        "## Acceptance and cost (held-out prompts, float32, batch 1)",
        "",
        f"Measured {card['when'][:10]} by `{card['command']}` ({card['machine']['threads']} threads).",
        "Acceptance is accepted / proposed draft tokens over all rounds; greedy rounds are replayed",
        "exactly on the target's greedy continuation, T=0.7 rounds are real speculative sampling with",
        "specserve's own sampler and verifier.",
        "",
    ]

    def acc(kind: str, mode: str, g: str) -> str:
        row = card[kind][mode].get(g)
        return f"{row['acceptance']:.3f}" if row else "-"

    gammas = sorted({*card["chat"]["greedy"], *card["chat"]["t0.7"]}, key=int)
    lines += md.table(
        ("gamma", "chat, T=0", "code, T=0", "chat, T=0.7", "code, T=0.7"),
        ((g, acc("chat", "greedy", g), acc("code", "greedy", g), acc("chat", "t0.7", g), acc("code", "t0.7", g))
         for g in gammas),
    )  # fmt: skip
    c, k = card["chat"], card["code"]
    lines += [
        "",
        f"Greedy: {c['prompts']} chat and {k['prompts']} code prompts, up to {c['max_new_tokens']} tokens each",
        f"({c['greedy_tokens']} and {k['greedy_tokens']} target tokens). T=0.7: {c['t0.7_prompts']} prompts per set,",
        f"{c['t0.7_max_new_tokens']} tokens each, seeded.",
        "",
        f"Cost: one target decode step {costs['target_step_ms']:.1f} ms, one draft step {costs['draft_step_ms']:.2f} ms",
        f"after a {costs['context_tokens']}-token context: **ratio {ratio:.1f}**. The target's pass over k positions,",
        "relative to one step: "
        + ", ".join(f"k={kk}: {v:.2f}x" for kk, v in costs["verify_k_over_target_step"].items())
        + ".",
        "",
        "## Against the targets set for it",
        "",
        f"- Greedy acceptance at gamma = 4 on held-out chat: {chat4:.3f} (target: at least 0.55, break-even on",
        f"  this CPU; aim 0.7): **{'met' if chat4 >= 0.55 else 'missed'}**.",
        f"- Target-step / draft-step cost ratio in float32: {ratio:.1f} (target: at least 8):"
        f" **{'met' if ratio >= 8 else 'missed'}**.",
        "",
        "## Reproduce",
        "",
        "```bash",
        "python scripts/distill_draft.py generate"
        + "".join(
            f" --{k.replace('_', '-')} {v}"
            for k, v in (meta.get("generate_args") or {}).items()
            if k != "gen_dtype" and v is not None
        )
        + "   # the target answers the training prompts (resumable)",
        f"python scripts/distill_draft.py train --steps {meta['step']} --lr {args['lr']}   # resumable",
        "python scripts/distill_draft.py export",
        f"{card['command']}",
        "specserve bench draft-card --render specserve/models/specserve-smollm2-draft   # this README",
        "```",
        "",
    ]
    return "\n".join(lines)


def main(opts: DraftCardOptions) -> int:
    """``specserve bench draft-card``: the figures (to ``--json``), or with ``--render DRAFT_DIR`` the model
    card from them."""
    if opts.render is not None:
        card = json.loads((opts.render / "card.json").read_text())
        meta = json.loads((opts.render / "training_meta.json").read_text())
        path = md.write(opts.render, "README", render_card(card, meta, opts.render.name))
        print(f"wrote {path}")
        return 0
    result = run(opts)
    if opts.json is not None:
        md.write_json(opts.json, result)
    return 0
