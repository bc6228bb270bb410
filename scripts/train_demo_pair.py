#!/usr/bin/env python
"""Train specserve's embedded default draft/target model pair on CPU.

The training material is the Python standard library's own ``.py`` sources,
which every machine running specserve has. The recipe:

1. List the stdlib ``.py`` files (no ``site-packages``, no test directories,
   UTF-8 only), sorted by relative path. Every file whose sorted index is
   ``0 mod --heldout-every`` is held out for evaluation.
2. Train a byte-level BPE tokenizer (vocab 8192, ``<|endoftext|>`` as
   EOS/BOS/PAD) on the training files and wrap it as a
   ``PreTrainedTokenizerFast``.
3. Train the **target** ``LlamaForCausalLM`` with next-token cross-entropy.
4. Train the **draft** ``LlamaForCausalLM`` by distillation: forward KL to the
   target's full next-token distribution, mixed with a little cross-entropy.
5. Save both in float16 safetensors, each directory with the tokenizer, so each
   loads standalone with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Everything is seeded; checkpoints go to ``--work-dir`` (outside git) every
``--ckpt-every`` steps and ``--resume`` continues from them. ``--probe`` only
times a few training steps of each model (fp32 vs bf16 autocast) so that step
counts can be chosen to fit a wall-clock budget.

Examples::

    python scripts/train_demo_pair.py --probe
    python scripts/train_demo_pair.py --target-steps 1200 --draft-steps 900
    python scripts/train_demo_pair.py --export-only   # export the latest checkpoints
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

log = logging.getLogger("train_demo_pair")

EOS = "<|endoftext|>"
TEST_DIR_NAMES = {"test", "tests", "idle_test", "__pycache__", "site-packages"}


# --------------------------------------------------------------------------- data


def list_stdlib_files(stdlib: Path) -> list[Path]:
    """Sorted stdlib ``.py`` files: no site-packages, no test dirs, UTF-8 only."""
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in TEST_DIR_NAMES and not d.startswith("."))
        for name in names:
            if name.endswith(".py"):
                files.append(Path(root) / name)
    files.sort(key=lambda p: p.relative_to(stdlib).as_posix())
    keep = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            keep.append(p)
    return keep


def split_files(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    train = [p for i, p in enumerate(files) if i % every != 0]
    held = [p for i, p in enumerate(files) if i % every == 0]
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in files]


def encode_stream(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """Concatenate documents as ``EOS doc EOS doc ...`` into one uint16 stream."""
    enc = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    total = sum(len(e.ids) + 1 for e in enc)
    out = np.empty(total, dtype=np.uint16)
    pos = 0
    for e in enc:
        out[pos] = eos_id
        out[pos + 1 : pos + 1 + len(e.ids)] = e.ids
        pos += 1 + len(e.ids)
    return out


class Batcher:
    """Random windows of ``seq_len + 1`` tokens from a stream, seeded."""

    def __init__(self, stream: np.ndarray, batch: int, seq_len: int, seed: int):
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.batch = batch
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        hi = len(self.stream) - self.seq_len - 1
        starts = torch.randint(0, hi, (self.batch,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self.stream[idx]

    def state_dict(self):
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.gen.set_state(sd["gen"])


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced, fixed held-out windows of ``seq_len + 1`` tokens."""
    s = torch.from_numpy(stream.astype(np.int64))
    hi = len(s) - seq_len - 1
    starts = torch.linspace(0, hi, n).long()
    return s[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, seq_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=seq_len,
        clean_up_tokenization_spaces=False,
    )
    return fast


# --------------------------------------------------------------------------- models


def make_config(vocab: int, d: int, layers: int, heads: int, ff: int, max_pos: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def make_model(cfg):
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg_seed(cfg))
    return LlamaForCausalLM(cfg)


def cfg_seed(cfg) -> int:
    return 1000 + cfg.hidden_size * 10 + cfg.num_hidden_layers


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor * peak``
    as ``progress`` (fraction of the step or time budget used) goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, bf16: bool, batch: int = 8) -> float:
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        with autocast(bf16):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        n += w[:, 1:].numel()
    model.train()
    return tot / n


def distill_loss(student_logits, teacher_logits, labels, kd_weight: float):
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (t.exp() * (t - s)).sum(-1).mean()
    ce = F.nll_loss(s.reshape(-1, s.shape[-1]), labels.reshape(-1))
    return kd_weight * kl + (1 - kd_weight) * ce, kl.detach(), ce.detach()


# --------------------------------------------------------------------------- training


def train_model(
    name: str,
    model,
    batcher: Batcher,
    windows: torch.Tensor,
    steps: int,
    args,
    ckpt_path: Path,
    teacher=None,
    history: list | None = None,
):
    """Train ``model`` for ``steps`` steps (distilling from ``teacher`` if given)."""
    peak = args.target_lr if teacher is None else args.draft_lr
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    start = 0
    history = history if history is not None else []
    budget_s = 60 * (args.target_minutes if teacher is None else args.draft_minutes)
    elapsed_before = 0.0
    if args.resume and ckpt_path.exists():
        sd = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        batcher.load_state_dict(sd["batcher"])
        start = sd["step"]
        history[:] = sd["history"]
        torch.set_rng_state(sd["rng"])
        elapsed_before = sd.get("elapsed_s", 0.0)
        log.info("%s: resumed from %s at step %d", name, ckpt_path, start)
    if start >= steps:
        return history

    def save(step):
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "batcher": batcher.state_dict(),
                "step": step,
                "history": history,
                "rng": torch.get_rng_state(),
                "total_steps": steps,
                "elapsed_s": elapsed_before + time.time() - t0,
            },
            tmp,
        )
        os.replace(tmp, ckpt_path)

    model.train()
    deadline = args.deadline_unix if teacher is not None else (args.target_deadline_unix or args.deadline_unix)
    t0 = time.time()
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps, mininterval=5, file=sys.stderr)
    ema = None
    def progress(step):
        p = (step - args.warmup) / max(1, steps - args.warmup)
        if budget_s > 0:
            p = max(p, (elapsed_before + time.time() - t0) / budget_s)
        return p

    for step in bar:
        lr = lr_at(step, progress(step), peak, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batcher.next()
        x, y = batch[:, :-1], batch[:, 1:]
        with autocast(args.bf16):
            logits = model(input_ids=x).logits
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=x).logits
        if teacher is None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            extra = {}
        else:
            loss, kl, ce = distill_loss(logits, t_logits, y, args.kd_weight)
            extra = {"kl": round(kl.item(), 4), "ce": round(ce.item(), 4)}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", **extra)
        done = step + 1
        if done % args.log_every == 0:
            rate = (time.time() - t0) / (done - start)
            log.info("%s step %d/%d loss(ema) %.4f lr %.2e %s %.2f s/step", name, done, steps, ema, lr, extra, rate)
        if done % args.eval_every == 0 or done == steps:
            hl = heldout_loss(model, windows, args.bf16)
            history.append({"step": done, "train_loss_ema": ema, "heldout_loss": hl, "elapsed_s": elapsed_before + time.time() - t0, **extra})
            log.info("%s step %d held-out loss %.4f", name, done, hl)
        if done % args.ckpt_every == 0 or done == steps:
            save(done)
        if budget_s > 0 and done < steps and done > args.warmup and progress(done) >= 1.0:
            log.info("%s: time budget of %.1f min used at step %d (lr schedule was time-based)",
                     name, budget_s / 60, done)
            hl = heldout_loss(model, windows, args.bf16)
            history.append({"step": done, "train_loss_ema": ema, "heldout_loss": hl,
                            "elapsed_s": elapsed_before + time.time() - t0, "stopped_at_time_budget": True, **extra})
            log.info("%s step %d held-out loss %.4f", name, done, hl)
            save(done)
            break
        if deadline and time.time() > deadline and done < steps:
            log.warning("%s: deadline reached at step %d/%d; stopping early", name, done, steps)
            save(done)
            history.append({"step": done, "stopped_early_at_deadline": True})
            break
    bar.close()
    return history


# --------------------------------------------------------------------------- export


def export(model, tokenizer, out_dir: Path, meta: dict, max_pos: int):
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.model_max_length = max_pos
    m = model.to(torch.float16)
    m.config.use_cache = True
    m.generation_config.bos_token_id = tokenizer.bos_token_id
    m.generation_config.eos_token_id = tokenizer.eos_token_id
    m.generation_config.pad_token_id = tokenizer.pad_token_id
    m.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "training_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    model.to(torch.float32)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path("models"), help="where the two model dirs go")
    ap.add_argument("--target-name", default="specserve-demo-target")
    ap.add_argument("--draft-name", default="specserve-demo-draft")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/specserve-train"), help="tokenized data and checkpoints")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--heldout-every", type=int, default=20)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-d", type=int, default=256)
    ap.add_argument("--target-layers", type=int, default=10)
    ap.add_argument("--target-heads", type=int, default=4)
    ap.add_argument("--target-ff", type=int, default=688)
    ap.add_argument("--draft-d", type=int, default=192)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-heads", type=int, default=3)
    ap.add_argument("--draft-ff", type=int, default=512)
    ap.add_argument("--target-steps", type=int, default=850)
    ap.add_argument("--draft-steps", type=int, default=650)
    ap.add_argument("--target-minutes", type=float, default=0.0,
                    help="wall-clock budget of the target phase; if > 0 the cosine schedule follows "
                         "max(step fraction, time fraction) and the phase ends when either is used up")
    ap.add_argument("--draft-minutes", type=float, default=0.0, help="same for the draft phase")
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--kd-weight", type=float, default=0.8, help="weight of KL(target||draft); rest is CE")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16 autocast (off by default: on CPUs without AVX-512 bf16 it is emulated and far slower)")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads; on an oversubscribed machine 1 can be several times faster")
    ap.add_argument("--resume", action="store_true", help="continue from checkpoints in --work-dir")
    ap.add_argument("--deadline", default=None, help="UTC HH:MM; stop training early (and record it) after it")
    ap.add_argument("--target-deadline", default=None, help="UTC HH:MM; stop the target phase early after it")
    ap.add_argument("--probe", action="store_true", help="only time a few steps and exit")
    ap.add_argument("--export-only", action="store_true", help="export the latest checkpoints and exit")
    ap.add_argument("--write-cards", type=Path, default=None, metavar="BENCH_JSON",
                    help="only write README.md model cards from training_meta.json and this bench JSON")
    ap.add_argument("--skip-target", action="store_true", help="reuse the saved target checkpoint as is")
    return ap.parse_args(argv)


def deadline_unix(hhmm: str | None) -> float | None:
    if not hhmm:
        return None
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc)
    h, m = map(int, hhmm.split(":"))
    d = now.replace(hour=h, minute=m, second=0, microsecond=0)
    if d < now - dt.timedelta(hours=12):
        d += dt.timedelta(days=1)
    return d.timestamp()


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv=None):
    args = parse_args(argv)
    if args.write_cards:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        write_cards(args.out_dir, args.target_name, args.draft_name, args.write_cards)
        return
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(args.work_dir / "train.log")],
    )
    torch.set_num_threads(args.threads)
    seed_all(args.seed)
    args.deadline_unix = deadline_unix(args.deadline)
    args.target_deadline_unix = deadline_unix(args.target_deadline)
    log.info("args: %s", vars(args))

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = list_stdlib_files(stdlib)
    train_files, held_files = split_files(files, args.heldout_every)
    rel = [p.relative_to(stdlib).as_posix() for p in files]
    held_rel = [p.relative_to(stdlib).as_posix() for p in held_files]
    log.info("stdlib %s: %d files, %d train, %d held out", stdlib, len(files), len(train_files), len(held_files))

    tok_dir = args.work_dir / "tokenizer"
    data_path = args.work_dir / "data.npz"
    if tok_dir.exists() and data_path.exists() and (args.resume or args.export_only):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        d = np.load(data_path)
        train_stream, held_stream = d["train"], d["held"]
        log.info("loaded tokenizer and token streams from %s", args.work_dir)
    else:
        t = time.time()
        train_texts = read_texts(train_files)
        tokenizer = train_tokenizer(train_texts, args.vocab_size, args.seq_len)
        log.info("tokenizer trained in %.1fs: vocab %d", time.time() - t, len(tokenizer))
        eos_id = tokenizer.eos_token_id
        train_stream = encode_stream(tokenizer, train_texts, eos_id)
        held_stream = encode_stream(tokenizer, read_texts(held_files), eos_id)
        tokenizer.save_pretrained(tok_dir)
        np.savez(data_path, train=train_stream, held=held_stream)
    eos_id = tokenizer.eos_token_id
    assert len(tokenizer) == args.vocab_size, len(tokenizer)
    log.info("tokens: train %d, held-out %d; eos id %d", len(train_stream), len(held_stream), eos_id)

    windows = eval_windows(held_stream, args.seq_len, args.eval_windows)
    tcfg = make_config(args.vocab_size, args.target_d, args.target_layers, args.target_heads, args.target_ff, args.max_pos, eos_id)
    dcfg = make_config(args.vocab_size, args.draft_d, args.draft_layers, args.draft_heads, args.draft_ff, args.max_pos, eos_id)
    target = make_model(tcfg)
    draft = make_model(dcfg)
    log.info("target params %d, draft params %d", n_params(target), n_params(draft))

    if args.probe:
        probe(target, draft, Batcher(train_stream, args.batch, args.seq_len, args.seed), args)
        return

    t_ckpt = args.work_dir / "target.pt"
    d_ckpt = args.work_dir / "draft.pt"
    t_hist: list = []
    d_hist: list = []

    if args.export_only:
        for m, ck, h in ((target, t_ckpt, t_hist), (draft, d_ckpt, d_hist)):
            sd = torch.load(ck, weights_only=False)
            m.load_state_dict(sd["model"])
            h[:] = sd["history"] + [{"exported_at_step": sd["step"], "of_planned": sd["total_steps"]}]
    else:
        if args.skip_target:
            sd = torch.load(t_ckpt, weights_only=False)
            target.load_state_dict(sd["model"])
            t_hist = sd["history"]
        else:
            seed_all(args.seed)
            train_model("target", target, Batcher(train_stream, args.batch, args.seq_len, args.seed), windows,
                        args.target_steps, args, t_ckpt, history=t_hist)
        target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        seed_all(args.seed + 1)
        train_model("draft", draft, Batcher(train_stream, args.batch, args.seq_len, args.seed + 1), windows,
                    args.draft_steps, args, d_ckpt, teacher=target, history=d_hist)

    # final held-out losses in float32 on the same fixed windows
    t_loss = heldout_loss(target, windows, bf16=False)
    d_loss = heldout_loss(draft, windows, bf16=False)
    log.info("final held-out loss (fp32): target %.4f draft %.4f", t_loss, d_loss)

    common = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "stdlib": str(stdlib),
        "n_files": len(files),
        "n_train_files": len(train_files),
        "n_heldout_files": len(held_files),
        "heldout_rule": f"sorted index % {args.heldout_every} == 0 (files sorted by path relative to stdlib)",
        "train_tokens": len(train_stream),
        "heldout_tokens": len(held_stream),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "seed": args.seed,
        "heldout_eval": f"{args.eval_windows} fixed windows of {args.seq_len} tokens, float32",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "argv": args.argv,
        "heldout_files": held_rel,
        "all_files": rel,
    }
    export(target, tokenizer, args.out_dir / args.target_name,
           {"role": "target", "params": n_params(target), "heldout_loss": t_loss, "history": t_hist, **common},
           args.max_pos)
    export(draft, tokenizer, args.out_dir / args.draft_name,
           {"role": "draft", "params": n_params(draft), "heldout_loss": d_loss, "history": d_hist,
            "distilled_from": args.target_name, "kd_weight": args.kd_weight, **common}, args.max_pos)
    for name in (args.target_name, args.draft_name):
        (args.out_dir / name / "heldout_files.json").write_text(json.dumps(
            {"rule": common["heldout_rule"], "stdlib": str(stdlib), "python": common["python"], "files": held_rel},
            indent=1) + "\n")
    log.info("exported to %s", args.out_dir)


# --------------------------------------------------------------------------- model cards


def _fmt_hist(hist: list) -> str:
    rows = [h for h in hist if "heldout_loss" in h]
    if not rows:
        return "(none recorded)"
    out = ["| step | held-out loss | elapsed (min) |", "| ---: | ---: | ---: |"]
    for h in rows:
        out.append(f"| {h['step']} | {h['heldout_loss']:.3f} | {h.get('elapsed_s', 0) / 60:.1f} |")
    return "\n".join(out)


def write_cards(out_dir: Path, target_name: str, draft_name: str, bench_json: Path):
    """Write README.md model cards from training_meta.json and a bench JSON."""
    b = json.loads(bench_json.read_text())
    metas = {n: json.loads((out_dir / n / "training_meta.json").read_text()) for n in (target_name, draft_name)}
    cfgs = {n: json.loads((out_dir / n / "config.json").read_text()) for n in (target_name, draft_name)}
    sizes = {n: (out_dir / n / "model.safetensors").stat().st_size for n in (target_name, draft_name)}
    g, tf, c = b["greedy"], b["teacher_forced"], b["costs"]
    k = g["gamma"] + 1
    ratio_ok = c["target_over_draft_step"] >= 5
    acc_ok = g["acceptance"] >= 0.6
    req = [
        f"- target/draft decode-step cost ratio >= 5: **{'met' if ratio_ok else 'NOT met'}** "
        f"(measured {c['target_over_draft_step']:.2f}x)",
        f"- greedy acceptance at gamma={g['gamma']} >= 0.6: **{'met' if acc_ok else 'NOT met'}** "
        f"(measured {g['acceptance']:.3f})",
    ]
    figures = f"""Measured by

```
{b['command']}
```

on {b['date_utc']}, {b['machine']}. Other engineers' jobs share this
2-core machine (1-minute load average {b['cpu_load_avg_1m_at_start']:.1f} at the start, {b['cpu_load_avg_1m_at_end']:.1f}
at the end), so milliseconds are noisy; the interleaved ratios are more
meaningful than absolute times. Full results: `bench_demo_pair.json` in
`{target_name}/`.

| what | value |
| --- | --- |
| (a) greedy acceptance at gamma={g['gamma']} (accepted / proposed) | **{g['acceptance']:.3f}** ({g['accepted']}/{g['proposed']}, {g['rounds']} rounds, {g['prompts']} held-out prompts of {b.get('prompt_len', '?')} tokens, {g['max_new_tokens']} new tokens each) |
| tokens committed per target pass | {g['tokens_per_round']:.2f} |
| speculative output identical to target-only greedy | {g['outputs_identical_to_target_greedy']}/{g['prompts']} prompts |
| wall-clock speedup of in-process speculative greedy vs target-only greedy | {g['wall_clock_speedup']:.2f}x |
| (b) alpha at T=1, E[sum_x min(p, q)] | **{tf['alpha_T1']:.3f}** ({tf['positions']} teacher-forced held-out positions) |
| (c) greedy agreement, argmax p == argmax q | **{tf['greedy_agreement']:.3f}** |
| held-out loss on those positions, target / draft (nats/token) | {tf['target_loss']:.3f} / {tf['draft_loss']:.3f} |
| (d) target decode step (KV cache, batch 1, median of {c['steps']}) | {c['target_step_ms']:.2f} ms |
| draft decode step | {c['draft_step_ms']:.2f} ms |
| target / draft step cost | **{c['target_over_draft_step']:.2f}x** |
| one target pass over {k} positions (verify gamma={g['gamma']}) | {c[f'target_verify_{k}_ms']:.2f} ms = {c[f'verify_{k}_over_target_step']:.2f}x one step |

Requirements of issue 5:

{chr(10).join(req)}
"""
    for role, name in (("target", target_name), ("draft", draft_name)):
        m, cfg = metas[name], cfgs[name]
        a = m["args"]
        other = draft_name if role == "target" else target_name
        steps = max((h.get("step", 0) for h in m["history"]), default=0)
        minutes = max((h.get("elapsed_s", 0) for h in m["history"]), default=0) / 60
        early = any(h.get("stopped_early_at_deadline") for h in m["history"])
        if role == "target":
            objective = "next-token cross-entropy"
            lr, budget = a["target_lr"], a["target_minutes"]
        else:
            objective = (f"distillation from `{target_name}`: {m['kd_weight']} x KL(target || draft) over the full "
                         f"next-token distribution at temperature 1 + {1 - m['kd_weight']:.1f} x cross-entropy on the data; "
                         "the target's soft labels are computed on the fly on the same batches")
            lr, budget = a["draft_lr"], a["draft_minutes"]
        card = f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [specserve, speculative-decoding, {role}, python, code]
---

# {name}

The **{role}** half of specserve's embedded default draft/target pair (its
partner is `{other}`). Both share one tokenizer and vocabulary, so the pair
can run speculative decoding out of the box with no model hub access. They are
small models trained for {minutes:.0f} minutes on a busy 2-core CPU: good enough to
exercise and measure the serving system, not to write useful code.

Load standalone:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/{name}")
model = AutoModelForCausalLM.from_pretrained("models/{name}")  # float16 weights; pass dtype=torch.float32 for exact greedy
```

## Architecture

| | |
| --- | --- |
| class | `LlamaForCausalLM` (standard transformers architecture) |
| hidden size / layers / heads | {cfg['hidden_size']} / {cfg['num_hidden_layers']} / {cfg['num_attention_heads']} (head dim {cfg['head_dim']}) |
| MLP intermediate size | {cfg['intermediate_size']} (SiLU-gated) |
| vocabulary | {cfg['vocab_size']} (byte-level BPE) |
| positions | RoPE, theta {cfg['rope_parameters']['rope_theta']:.0f}; trained on {m['seq_len']}-token windows, `max_position_embeddings` {cfg['max_position_embeddings']} |
| embeddings | input and output embeddings tied |
| parameters | {m['params']:,} |
| weights | float16 safetensors, {sizes[name] / 1e6:.1f} MB (pair total {sum(sizes.values()) / 1e6:.1f} MB) |
| special tokens | `<|endoftext|>` = id {cfg['eos_token_id']} is EOS, BOS and PAD |

## Tokenizer

Byte-level BPE (`tokenizers`), vocabulary {cfg['vocab_size']} including the one special
token `<|endoftext|>`, trained on the training split only; saved as a
`PreTrainedTokenizerFast`. No BOS is added automatically. Identical files in
both model directories.

## Training data and split

The `.py` files of the Python {m['python']} standard library
(`sysconfig.get_paths()['stdlib']`), excluding `site-packages` and the test
directories (`test`, `tests`, `idle_test`) and any file that is not UTF-8:
{m['n_files']} files, sorted by path relative to the stdlib root. **Held out by file:**
{m['heldout_rule']}: {m['n_heldout_files']} files ({m['heldout_tokens']:,} tokens), listed in
`heldout_files.json`; the other {m['n_train_files']} files ({m['train_tokens']:,} tokens) are
the training split. Documents are joined as `<|endoftext|> doc <|endoftext|> doc ...`
and training samples random {m['seq_len']}-token windows.

## Training

- objective: {objective}
- {steps} optimizer steps of batch {m['batch']} x {m['seq_len']} tokens ({steps * m['batch'] * m['seq_len']:,} tokens seen), AdamW (betas 0.9/0.95, weight decay 0.1), peak lr {lr}, {a['warmup']} warm-up steps, then cosine decay to 10% driven by a wall-clock budget of {budget:g} minutes (`--{role}-minutes`): the schedule follows max(step fraction, time fraction) and the phase ends when the budget is used{' (stopped early at the deadline)' if early else ''}
- float32 on CPU, {a['threads']} torch thread(s), seed {m['seed']}. bf16 autocast was measured and not used: this CPU has no AVX-512 bf16, so bf16 was many times slower than float32.
- the machine (2 cores) was shared with other engineers' test runs at the same time, which is why training was short.

{chr(10).join("- " + n for n in m.get("notes", []))}

Held-out loss during training ({m['heldout_eval']}):

{_fmt_hist(m['history'])}

**Final held-out loss: {m['heldout_loss']:.3f} nats/token** ({m['heldout_eval']}).

## Measured figures of the pair

{figures}
## Precision

Greedy speculative decoding with this pair is token-identical to target-only
greedy decoding in **float32** (checked by `tests/test_demo_pair.py` and by the
benchmark above). The weights are stored in float16; in float16/bf16 compute,
batched verification and single-step decoding round differently and a near-tie
can flip an argmax, so token identity is only guaranteed in float32.

## Reproduce

```
{chr(10).join(m["commands"]) if m.get("commands") else "python scripts/train_demo_pair.py " + " ".join(m.get("argv", []))}
{b['command']}
python scripts/train_demo_pair.py --write-cards models/{target_name}/bench_demo_pair.json
```

Training with a time budget is not bit-reproducible (the number of steps
depends on the machine's speed); `training_meta.json` records the exact steps
and arguments. With `--target-minutes 0 --draft-minutes 0` and explicit
`--target-steps/--draft-steps` the run is step-based and seeded.
"""
        (out_dir / name / "README.md").write_text(card)
        log.info("wrote %s", out_dir / name / "README.md")


def probe(target, draft, batcher, args, n: int = 4):
    """Time training steps of both models, fp32 vs bf16 autocast."""
    for bf16 in ((False, True) if args.bf16 else (False,)):
        for name, m, teacher in (("target", target, None), ("draft", draft, target)):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            times = []
            for _ in range(n + 1):
                b = batcher.next()
                t = time.time()
                with autocast(bf16):
                    logits = m(input_ids=b[:, :-1]).logits
                    if teacher is not None:
                        with torch.no_grad():
                            tl = teacher(input_ids=b[:, :-1]).logits
                if teacher is None:
                    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
                else:
                    loss = distill_loss(logits, tl, b[:, 1:], args.kd_weight)[0]
                opt.zero_grad()
                loss.backward()
                opt.step()
                times.append(time.time() - t)
            log.info("probe %s bf16=%s: %.2f s/step (median of %d, batch %d x %d)", name, bf16,
                     float(np.median(times[1:])), n, args.batch, args.seq_len)


if __name__ == "__main__":
    main()
