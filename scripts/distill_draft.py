"""Distil the default pair's draft from the target, on this machine, resumably.

Stages (each resumable; run them in order, or ``all``)::

    python scripts/distill_draft.py generate   # the target answers the training prompts
    python scripts/distill_draft.py train      # KL distillation of the early-exit draft
    python scripts/distill_draft.py export     # fp16 model directory in specserve/models/
    python scripts/distill_draft.py all

``generate`` runs the target (bfloat16 for speed) over the training prompts of
:mod:`specserve.prompts.chat` (held-out subjects never appear), greedy for some
prompts and sampled at temperature 0.7 for the rest, then a second turn for
prompts with a follow-up question. It keeps, for every generated position, the
target's top-``K`` log-probabilities (raw logits, before any warper): the
distillation target. Each batch is one shard file in the work directory; a
restarted run skips the shards it already has.

``train`` builds the draft from the target (:mod:`specserve.engine.draft_model`): the
target's first ``--layers`` decoder layers and final norm, a low-rank input
embedding from the SVD of the target's embedding, and an output head over the
``--head-size`` tokens the target emits most. It minimises KL(p_target || q_draft)
over the top-K support (renormalised to the head's tokens) plus a cross-entropy
term on the target's top token (greedy agreement), with AdamW and a cosine
schedule. A checkpoint is written every ``--checkpoint-every`` steps and at
the end; a restarted run resumes from the last one. Held-out loss, KL and
top-1 agreement are measured on answers to held-out prompts.

``export`` writes the draft in float16 to ``specserve/models/specserve-smollm2-draft``
with the target's tokenizer and chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.prompts.chat import ChatPrompt, heldout_prompts, training_prompts  # noqa: E402

TOP_K = 20
DEFAULT_WORK = Path(os.environ.get("SPECSERVE_DISTILL_DIR", Path.home() / ".cache" / "specserve" / "distill"))


def _tqdm():
    from tqdm.auto import tqdm

    return tqdm


# ------------------------------------------------------------------------------------------ generate


class _TopK:
    """A logits processor that records the top-K raw log-probabilities of every step (returns scores as is)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float(), dim=-1)  # [B, vocab]
        top = torch.topk(logp, self.k, dim=-1)
        self.steps.append((top.indices.to(torch.int32), top.values.to(torch.float16)))
        return scores


def _mode(prompt: ChatPrompt) -> str:
    """Greedy for about 60% of the prompts, temperature 0.7 for the rest (a stable hash)."""
    return "greedy" if hashlib.sha256(prompt.name.encode()).digest()[0] < 154 else "t0.7"


def _conversation(prompt: ChatPrompt, first_answer: str | None) -> list[dict[str, str]]:
    messages = [dict(m) for m in prompt.messages]
    if first_answer is not None:
        assert prompt.follow_up is not None
        messages += [
            {"role": "assistant", "content": first_answer},
            {"role": "user", "content": prompt.follow_up},
        ]
    return messages


def _generate_batch(model, tok, convs: list[list[dict[str, str]]], mode: str, max_new: int) -> list[dict]:
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    recorder = _TopK(TOP_K)
    kwargs = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "temperature": 0.7, "top_k": 0}
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=max_new,
            logits_processor=[recorder],
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            **kwargs,
        )
    width = enc["input_ids"].shape[1]
    ids = torch.stack([s[0] for s in recorder.steps], dim=1)  # [B, steps, K]
    logp = torch.stack([s[1] for s in recorder.steps], dim=1)  # [B, steps, K]
    rows = []
    for b in range(len(convs)):
        prompt_ids = enc["input_ids"][b][enc["attention_mask"][b].bool()].tolist()
        completion = out[b, width:].tolist()
        if tok.eos_token_id in completion:
            completion = completion[: completion.index(tok.eos_token_id) + 1]
        m = len(completion)
        rows.append(
            {
                "ids": torch.tensor(prompt_ids + completion, dtype=torch.int32),
                "prompt_len": len(prompt_ids),
                "topk_ids": ids[b, :m].clone(),
                "topk_logp": logp[b, :m].clone(),
                "mode": mode,
                "text": tok.decode(completion, skip_special_tokens=True),
            }
        )
    return rows


def generate(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    shards = args.work / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.target)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.gen_dtype)).eval()
    tqdm = _tqdm()

    def run(stage: str, jobs: list[tuple[ChatPrompt, str | None]]) -> None:
        batches: list[tuple[str, list[tuple[ChatPrompt, str | None]]]] = []
        for mode in ("greedy", "t0.7"):
            chosen = [j for j in jobs if _mode(j[0]) == mode]
            chosen.sort(key=lambda j: len(json.dumps(_conversation(*j))))
            for i in range(0, len(chosen), args.batch_size):
                batches.append((mode, chosen[i : i + args.batch_size]))
        bar = tqdm(batches, desc=f"generate {stage}", unit="batch")
        tokens = 0
        for index, (mode, batch) in enumerate(bar):
            path = shards / f"{stage}-{mode}-{index:04d}.pt"
            if path.exists():
                continue
            convs = [_conversation(p, answer) for p, answer in batch]
            rows = _generate_batch(model, tok, convs, mode, args.max_new_tokens)
            for (p, _), row in zip(batch, rows, strict=True):
                row["name"] = p.name + ("#2" if stage == "turn2" else "")
            torch.save(rows, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            tokens += sum(len(r["topk_ids"]) for r in rows)
            bar.set_postfix(tokens=tokens)

    (args.work / "generate.json").write_text(  # what the data came from: the card's reproduce line
        json.dumps({"limit": args.limit, "max_new_tokens": args.max_new_tokens, "gen_dtype": args.gen_dtype})
    )
    prompts = training_prompts()
    if args.limit is not None and args.limit < len(prompts):  # evenly spread: every subject, fewer phrasings
        prompts = [prompts[i * len(prompts) // args.limit] for i in range(args.limit)]
    run("turn1", [(p, None) for p in prompts])
    answers = {}
    for path in sorted(shards.glob("turn1-*.pt")):
        for row in torch.load(path):
            answers[row["name"]] = row["text"]
    follow = [(p, answers[p.name]) for p in prompts if p.follow_up and p.name in answers]
    run("turn2", follow)
    heldout = heldout_prompts("chat", args.heldout) + heldout_prompts("code", args.heldout)
    hshards = args.work / "heldout"
    hshards.mkdir(exist_ok=True)
    for mode in ("greedy", "t0.7"):
        path = hshards / f"{mode}.pt"
        if not path.exists():
            rows = []
            for i in tqdm(range(0, len(heldout), args.batch_size), desc=f"held-out {mode}"):
                chunk = heldout[i : i + args.batch_size]
                got = _generate_batch(
                    model, tok, [_conversation(p, None) for p in chunk], mode, args.max_new_tokens
                )
                for p, row in zip(chunk, got, strict=True):
                    row["name"] = p.name
                rows += got
            torch.save(rows, path)


# ------------------------------------------------------------------------------------------ train


def _load_rows(folder: Path, pattern: str) -> list[dict]:
    rows: list[dict] = []
    for path in sorted(folder.glob(pattern)):
        rows += torch.load(path)
    return rows


def head_tokens(rows: list[dict], size: int, eos_token_id: int) -> torch.Tensor:
    """The ``size`` tokens the target ranks first most often (generated tokens, then top-1), sorted."""
    counts = torch.zeros(200_000, dtype=torch.int64)
    for r in rows:
        completion = r["ids"][r["prompt_len"] :].long()
        counts.index_add_(0, completion, torch.ones_like(completion))
        counts.index_add_(0, r["topk_ids"][:, 0].long(), torch.ones(len(completion), dtype=torch.int64))
        counts.index_add_(0, r["topk_ids"][:, 1].long(), torch.ones(len(completion), dtype=torch.int64) // 2)
    counts[eos_token_id] += 1 << 40  # always keep EOS
    return torch.sort(torch.topk(counts, size).indices).values


class _Batches:
    """Training windows: each row's last ``max_len`` tokens, completion positions carry teacher rows."""

    def __init__(self, rows: list[dict], max_len: int) -> None:
        self.items = []
        for r in rows:
            n = len(r["ids"])
            start = max(0, n - max_len)
            self.items.append((r, start))
        self.max_len = max_len

    def batch(self, indices: list[int]):
        items = [self.items[i] for i in indices]
        width = max(len(r["ids"]) - s for r, s in items)
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        sel_b, sel_t, tk_ids, tk_logp = [], [], [], []
        for b, (r, s) in enumerate(items):
            seq = r["ids"][s:].long()
            ids[b, : len(seq)] = seq
            mask[b, : len(seq)] = 1
            p = r["prompt_len"]
            m = len(r["topk_ids"])
            # Teacher row j predicts token p + j, from input position p - 1 + j (window-relative: - s).
            for j in range(m):
                t = p - 1 + j - s
                if 0 <= t < len(seq):
                    sel_b.append(b)
                    sel_t.append(t)
            keep = [j for j in range(m) if 0 <= p - 1 + j - s < len(seq)]
            tk_ids.append(r["topk_ids"][keep].long())
            tk_logp.append(r["topk_logp"][keep].float())
        return ids, mask, torch.tensor(sel_b), torch.tensor(sel_t), torch.cat(tk_ids), torch.cat(tk_logp)


def distill_loss(logits_head, head_index, tk_ids, tk_logp, ce_weight):
    """KL(p || q) over the teacher's top-K restricted to the head, plus CE on the teacher's top-1.

    logits_head [N, H]; head_index [vocab] -> position in the head or -1; tk_ids/tk_logp [N, K].
    Returns (loss, kl, top1_agreement).
    """
    pos = head_index[tk_ids]  # [N, K]
    inside = pos >= 0
    p = torch.where(inside, tk_logp.exp(), torch.zeros_like(tk_logp))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)  # [N, K]
    logq = torch.log_softmax(logits_head.float(), dim=-1)  # [N, H]
    logq_k = logq.gather(-1, pos.clamp_min(0))  # [N, K]
    kl = (p * (torch.log(p.clamp_min(1e-12)) - logq_k)).sum(-1).mean()
    top1 = pos[:, 0]
    has_top1 = top1 >= 0
    ce = -(logq.gather(-1, top1.clamp_min(0)[:, None])[:, 0] * has_top1).sum() / has_top1.sum().clamp_min(1)
    agree = ((logits_head.argmax(-1) == top1) & has_top1).float().mean()
    return kl + ce_weight * ce, kl.detach(), agree.detach()


def _forward_head(model, ids, mask, sel_b, sel_t):
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, d]
    return model.lm_head.project(hidden[sel_b, sel_t])  # [N, H]


@torch.no_grad()
def evaluate(model, data: _Batches, head_index, batch_size: int, ce_weight: float) -> dict:
    """Held-out loss (the training objective), KL and top-1 agreement, weighted by positions."""
    model.eval()
    losses, kls, agrees, weights = [], [], [], []
    for i in range(0, len(data.items), batch_size):
        ids, mask, sb, st, ti, tl = data.batch(list(range(i, min(i + batch_size, len(data.items)))))
        logits = _forward_head(model, ids, mask, sb, st)
        loss, kl, agree = distill_loss(logits, head_index, ti, tl, ce_weight)
        losses.append(float(loss))
        kls.append(float(kl))
        agrees.append(float(agree))
        weights.append(len(sb))
    model.train()
    w = sum(weights)
    return {
        "loss": sum(x * n for x, n in zip(losses, weights, strict=True)) / w,
        "kl": sum(k * n for k, n in zip(kls, weights, strict=True)) / w,
        "top1_agreement": sum(a * n for a, n in zip(agrees, weights, strict=True)) / w,
        "positions": w,
    }


def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from specserve.engine.draft_model import draft_from_target

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tqdm = _tqdm()
    rows = _load_rows(args.work / "shards", "*.pt")
    held = _load_rows(args.work / "heldout", "*.pt")
    if not rows:
        raise SystemExit("no generated data: run `generate` first")
    ckpt_path = args.work / f"draft-L{args.layers}-H{args.head_size}-R{args.embed_rank}.pt"
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    eos = int(target.config.eos_token_id)
    if ckpt_path.exists():
        state = torch.load(ckpt_path)
        head = state["head_token_ids"]
    else:
        state = None
        head = head_tokens(rows, args.head_size, eos)
    model = draft_from_target(target, layers=args.layers, head_token_ids=head, embed_rank=args.embed_rank)
    del target
    head_index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    head_index[head] = torch.arange(len(head))
    coverage = float((head_index[torch.cat([r["topk_ids"][:, 0].long() for r in held])] >= 0).float().mean())
    train_data = _Batches(rows, args.max_len)
    held_data = _Batches(held, args.max_len)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    step, history = 0, []
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    model.train()
    gen = torch.Generator().manual_seed(1234)
    order = torch.randperm(len(train_data.items), generator=gen).tolist()
    per_epoch = len(order) // args.batch_size

    def lr_at(s: int) -> float:
        warm = max(10, min(100, args.steps // 20))
        if s < warm:
            return args.lr * (s + 1) / warm
        frac = (s - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    if not history:
        history.append(
            {
                "step": 0,
                "time_s": 0.0,
                **evaluate(model, held_data, head_index, args.batch_size, args.ce_weight),
            }
        )
        print(json.dumps(history[-1]), flush=True)
    bar = tqdm(total=args.steps, initial=step, desc="distil", unit="step")
    started = time.monotonic() - (history[-1]["time_s"] if history else 0.0)
    while step < args.steps:
        e, k = divmod(step, per_epoch)
        if k == 0 and e > 0:
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(1234 + e)).tolist()
        idx = order[k * args.batch_size : (k + 1) * args.batch_size]
        ids, mask, sb, st, ti, tl = train_data.batch(idx)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = _forward_head(model, ids, mask, sb, st)
        loss, kl, agree = distill_loss(logits, head_index, ti, tl, args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{float(kl):.3f}", agree=f"{float(agree):.3f}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            history.append(
                {
                    "step": step,
                    "time_s": time.monotonic() - started,
                    **evaluate(model, held_data, head_index, args.batch_size, args.ce_weight),
                }
            )
            print(json.dumps(history[-1]), flush=True)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "history": history,
                    "head_token_ids": head,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "heldout_top1_coverage": coverage,
                    "train_rows": len(rows),
                    "train_positions": sum(len(r["topk_ids"]) for r in rows),
                },
                ckpt_path.with_suffix(".tmp"),
            )
            ckpt_path.with_suffix(".tmp").rename(ckpt_path)
    bar.close()


# ------------------------------------------------------------------------------------------ export


def export(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.engine.draft_model import draft_from_target

    ckpt_path = args.work / f"draft-L{args.layers}-H{args.head_size}-R{args.embed_rank}.pt"
    state = torch.load(ckpt_path)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    model = draft_from_target(
        target, layers=args.layers, head_token_ids=state["head_token_ids"], embed_rank=args.embed_rank
    )
    model.load_state_dict(state["model"])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out)
    AutoTokenizer.from_pretrained(args.target).save_pretrained(out)
    meta = {
        "step": state["step"],
        "history": state["history"],
        "heldout_top1_coverage": state["heldout_top1_coverage"],
        "train_rows": state["train_rows"],
        "train_positions": state["train_positions"],
        "args": state["args"],
        "generate_args": json.loads((args.work / "generate.json").read_text())
        if (args.work / "generate.json").exists()
        else None,
    }
    (out / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stage", choices=["generate", "train", "export", "all"])
    parser.add_argument("--target", type=Path, default=None, help="target model directory (default: fetched)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--out", type=Path, default=ROOT / "specserve" / "models" / "specserve-smollm2-draft")
    parser.add_argument("--gen-dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument(
        "--limit", type=int, default=None, help="an evenly spread subset of N training prompts"
    )
    parser.add_argument("--heldout", type=int, default=40, help="held-out prompts per set for evaluation")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=8192)
    parser.add_argument("--embed-rank", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--ce-weight", type=float, default=0.5)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.target is None:
        from specserve.engine.model_registry import ensure_model

        args.target = ensure_model("smollm2-135m-instruct")
    if args.stage in ("generate", "all"):
        generate(args)
    if args.stage in ("train", "all"):
        train(args)
    if args.stage in ("export", "all"):
        export(args)


if __name__ == "__main__":
    main()
