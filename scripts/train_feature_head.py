"""Train the feature-conditioned draft head (``specserve.feature_head``) on the target's own answers.

Stages (each resumable; CUDA when present, else the CPU)::

    python scripts/train_feature_head.py generate   # the target answers many prompts -> token ids (data/)
    python scripts/train_feature_head.py train      # the head, on features recomputed from those ids
    python scripts/train_feature_head.py export     # the head's model directory in models/

``generate`` keeps token ids only (``data/smollm2-answers/*.npz.xz``, a few MB in
the repository): the target's features and distributions are recomputed from
them by one forward pass when training, so data accumulates across machines.
The prompts (``bench.chat_prompts``; held-out subjects never appear):

1. every training prompt, answered greedy and sampled at T = 0.7;
2. questions and programming tasks the target writes itself about training
   subjects (sampled at T = 1, filtered, deduplicated), answered greedy or at 0.7;
3. second turns: a follow-up question after the target's own first answer;
4. the held-out prompts, answered greedy: the evaluation set (never trained on).

Each batch is one shard; a restarted run skips the shards it has. ``--workers N``
splits the batches between N processes (one GPU serves several), and
``--time-budget`` stops starting batches after that many seconds.

``train`` runs the head unrolled on its own outputs (``FeatureHead.unrolled``,
EAGLE-3's training-time test), ``--steps`` deep: per step, KL(target || head)
over the head's tokens, cross-entropy on the target's top token, and a
smooth-L1 regression of the head's output on the true next feature.
``--fraction`` trains on a nested share of the data (the data-size curve).
Checkpoints every ``--checkpoint-every`` steps; a restarted run resumes.
Held-out: per unroll step, the share of positions where the head's top token is
the target's greedy token, and the expected accepted tokens per round at gamma
1..K (greedy acceptance replayed on the target's greedy answers).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import chat_prompts as cp  # noqa: E402
from specserve.feature_head import (  # noqa: E402
    FeatureHead,
    FinalNormInput,
    head_from_target,
    target_features,
)

DEFAULT_DATA = ROOT / "data" / "smollm2-answers"
DEFAULT_WORK = Path(os.environ.get("SPECSERVE_HEAD_DIR", Path.home() / ".cache" / "specserve" / "feature-head"))
KINDS = {"chat": 0, "code": 1}
MODES = {"greedy": 0, "t0.7": 1, "t1.0": 2}


def _tqdm():
    from tqdm.auto import tqdm

    return tqdm


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


# ------------------------------------------------------------------------------------------ data files


@dataclass(frozen=True)
class Record:
    """One conversation the target answered: its token ids, where its last answer starts, what it was."""

    key: str
    tokens: np.ndarray  # [n] uint16: the chat-formatted prompt, then the answer (EOS included when reached)
    prompt_len: int
    kind: int
    mode: int


def save_shard(path: Path, records: list[Record]) -> None:
    """Write records as one lzma-compressed npz (atomically)."""
    buf = io.BytesIO()
    lengths = np.array([len(r.tokens) for r in records], dtype=np.int64)
    np.savez(
        buf,
        tokens=np.concatenate([r.tokens for r in records]).astype(np.uint16),
        lengths=lengths,
        prompt_lens=np.array([r.prompt_len for r in records], dtype=np.int32),
        kinds=np.array([r.kind for r in records], dtype=np.uint8),
        modes=np.array([r.mode for r in records], dtype=np.uint8),
        keys=np.array("\n".join(r.key for r in records)),
    )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(lzma.compress(buf.getvalue(), preset=9))
    tmp.rename(path)


def load_shard(path: Path) -> list[Record]:
    with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as z:
        tokens, lengths = z["tokens"], z["lengths"]
        keys = str(z["keys"]).split("\n")
        out, start = [], 0
        for i, n in enumerate(lengths):
            out.append(
                Record(keys[i], tokens[start : start + n], int(z["prompt_lens"][i]), int(z["kinds"][i]),
                       int(z["modes"][i]))
            )
            start += int(n)
    return out


def load_records(folder: Path, prefix: str) -> list[Record]:
    out: list[Record] = []
    for path in sorted(folder.glob(f"{prefix}-*.npz.xz")):
        out += load_shard(path)
    return out


# ------------------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class Request:
    """One conversation to answer."""

    key: str
    kind: str
    messages: tuple[dict[str, str], ...]
    mode: str


def _mode(key: str, sampled_share: float = 0.5) -> str:
    return "t0.7" if (_hash(key) % 1000) < sampled_share * 1000 else "greedy"


def templated_requests() -> list[Request]:
    out = []
    for p in cp.training_prompts():
        for mode in ("greedy", "t0.7"):
            out.append(Request(f"{p.name}#{mode}", p.kind, p.messages, mode))
    return out


def heldout_requests() -> list[Request]:
    return [
        Request(f"{p.name}#heldout", p.kind, p.messages, "greedy")
        for kind in ("chat", "code")
        for p in cp.heldout_prompts(kind)
    ]


_CHAT_METAS = (
    "Write one question a curious person might ask an assistant about {t}. Reply with the question only.",
    "Write a short request someone could send to an AI assistant about {t}. Reply with the request only.",
    "Write a question a student might ask about {t}. Reply with the question only.",
)
_HOWTO_METAS = (
    "Write a question someone might ask when they want to {t}. Reply with the question only.",
    "Write a short request for help from someone who wants to {t}. Reply with the request only.",
)
_CODE_METAS = (
    "Write a short programming exercise: a {lang} function that {t}. Reply with the exercise only.",
    "Write a question a programmer might ask about a {lang} function that {t}. Reply with the question only.",
)
_CONCEPT_METAS = (
    "Write a question a programmer might ask about {t}. Reply with the question only.",
    "Write a short coding task in {lang} that uses {t}. Reply with the task only.",
)


def question_requests(samples: int) -> list[Request]:
    """Meta-prompts that ask the target for a user question about a training subject, ``samples`` each."""
    items = cp._items  # the subject lists' parser
    out = []
    groups = (
        ("chat", items(cp.TOPICS), _CHAT_METAS),
        ("chat", items(cp.TASKS), _HOWTO_METAS),
        ("code", items(cp.CODE_TASKS), _CODE_METAS),
        ("code", items(cp.CODE_CONCEPTS), _CONCEPT_METAS),
    )
    for kind, subjects, metas in groups:
        for subject in subjects:
            if cp.is_heldout(subject):
                continue
            for m, meta in enumerate(metas):
                for s in range(samples):
                    key = f"q/{kind}/{m}/{subject}/{s}"
                    lang = cp.LANGUAGES[_hash(key) % len(cp.LANGUAGES)]
                    text = meta.format(t=subject, lang=lang)
                    out.append(Request(key, kind, ({"role": "user", "content": text},), "t1.0"))
    return out


_HELDOUT_WORDS = None


def clean_question(text: str) -> str | None:
    """The question in a meta-prompt's answer, or None when it is unusable (or names a held-out subject)."""
    global _HELDOUT_WORDS
    if _HELDOUT_WORDS is None:
        subjects = []
        for block in (cp.TOPICS, cp.TASKS, cp.CODE_TASKS, cp.CODE_CONCEPTS):
            subjects += [s.lower() for s in cp._items(block) if cp.is_heldout(s)]
        _HELDOUT_WORDS = subjects
    quoted = re.findall(r'"([^"]{15,400})"', text)
    text = max(quoted, key=len) if quoted else text.strip().split("\n")[0]
    text = re.sub(r"^(question|request|exercise|task)\s*:\s*", "", text.strip(), flags=re.I).strip()
    if not 15 <= len(text) <= 400 or "<|" in text or len(text.split()) < 3 or text[-1] not in "?.":
        return None
    low = text.lower()
    if any(s in low for s in _HELDOUT_WORDS):
        return None
    return text


# ------------------------------------------------------------------------------------------ generate


def _load_target(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok


def _answer(model, tok, requests: list[Request], max_new: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per request, all of one mode, in one ``generate`` call."""
    texts = [tok.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=False) for r in requests]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    mode = requests[0].mode
    sampling = {"do_sample": False}
    if mode != "greedy":
        sampling = {"do_sample": True, "temperature": float(mode[1:]), "top_k": 0, "top_p": 1.0}
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sampling
        )
    width = enc["input_ids"].shape[1]
    rows = []
    for b in range(len(requests)):
        prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()].tolist()
        completion = out[b, width:].tolist()
        if tok.eos_token_id in completion:
            completion = completion[: completion.index(tok.eos_token_id) + 1]
        else:
            while completion and completion[-1] == tok.pad_token_id:
                completion.pop()
        rows.append((prompt, completion))
    return rows


def _run_phase(args, model, tok, phase: str, requests: list[Request], max_new: int, deadline: float) -> int:
    """Answer ``requests`` in batches of one mode, a shard per batch; returns the answer tokens written."""
    batches: list[list[Request]] = []
    for mode in MODES:
        chosen = sorted((r for r in requests if r.mode == mode), key=lambda r: (len(json.dumps(r.messages)), r.key))
        batches += [chosen[i : i + args.batch_size] for i in range(0, len(chosen), args.batch_size)]
    mine = [(i, b) for i, b in enumerate(batches) if i % args.workers == args.worker]
    written = 0
    bar = _tqdm()(mine, desc=f"{phase} (worker {args.worker})", unit="batch", disable=args.worker != 0)
    for index, batch in bar:
        path = args.data / f"{phase}-{index:05d}.npz.xz"
        if path.exists():
            continue
        if time.monotonic() > deadline:
            break
        rows = _answer(model, tok, batch, max_new, seed=_hash(f"{phase}/{index}") % 2**31)
        records = [
            Record(r.key, np.array(p + c, dtype=np.uint16), len(p), KINDS[r.kind], MODES[r.mode])
            for r, (p, c) in zip(batch, rows, strict=True)
        ]
        save_shard(path, records)
        written += sum(len(c) for _, c in rows)
        bar.set_postfix(tokens=written)
    return written


def generate(args: argparse.Namespace) -> None:
    device = _device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.data.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.time_budget or float("inf"))
    model, tok = _load_target(args.target, device, dtype)
    limit = (lambda xs: xs[: args.limit]) if args.limit else (lambda xs: xs)

    _run_phase(args, model, tok, "heldout", limit(heldout_requests()), args.heldout_tokens, deadline)
    templated = limit(templated_requests())
    _run_phase(args, model, tok, "turn1", templated, args.max_new_tokens, deadline)
    _barrier(args, "turn1", templated, deadline)
    follow = limit(_follow_ups(args, tok, "turn1"))
    _run_phase(args, model, tok, "turn2", follow, args.max_new_tokens, deadline)
    if args.questions:
        metas = limit(question_requests(args.questions))
        _run_phase(args, model, tok, "questions", metas, 64, deadline)
        _barrier(args, "questions", metas, deadline)
        asked = _self_instruct(args, tok)
        _run_phase(args, model, tok, "selfinstruct", limit(asked), args.max_new_tokens, deadline)
        _barrier(args, "selfinstruct", limit(asked), deadline)
        follow = limit(_follow_ups(args, tok, "selfinstruct"))
        _run_phase(args, model, tok, "turn2si", follow, args.max_new_tokens, deadline)


def _n_batches(args, requests: list[Request]) -> int:
    return sum(math.ceil(sum(r.mode == m for r in requests) / args.batch_size) for m in MODES)


def _barrier(args, phase: str, requests: list[Request], deadline: float) -> None:
    """Wait (until the deadline) for every worker's shards of ``phase``: the next phase reads them all."""
    expected = _n_batches(args, requests)
    while len(list(args.data.glob(f"{phase}-*.npz.xz"))) < expected and time.monotonic() < deadline:
        time.sleep(1)


def _self_instruct(args, tok) -> list[Request]:
    """The questions the target wrote (phase ``questions``), cleaned and deduplicated, as requests."""
    seen: set[str] = set()
    out = []
    for r in load_records(args.data, "questions"):
        text = tok.decode(r.tokens[r.prompt_len :].tolist(), skip_special_tokens=True)
        q = clean_question(text)
        if q is None or q.lower() in seen:
            continue
        seen.add(q.lower())
        kind = "code" if r.kind == KINDS["code"] else "chat"
        key = f"si/{r.key}"
        out.append(Request(key, kind, ({"role": "user", "content": q},), _mode(key)))
    return out


def _follow_ups(args, tok, prefix: str) -> list[Request]:
    """Second turns after ``prefix``'s greedy first answers that ended: the templated prompts' own
    follow-ups (``turn1``), or a generic one for a quarter of the self-instruct questions."""
    prompts = {f"{p.name}#greedy": p for p in cp.training_prompts()}
    out = []
    for r in load_records(args.data, prefix):
        if MODES["greedy"] != r.mode or not r.tokens[-1:].tolist() == [tok.eos_token_id]:
            continue
        if prefix == "turn1":
            p = prompts.get(r.key)
            if p is None or p.follow_up is None:
                continue
            first, follow = p.messages, p.follow_up
        else:
            if _hash(r.key) % 4:
                continue
            question = tok.decode(r.tokens[: r.prompt_len].tolist(), skip_special_tokens=False)
            user = question.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
            first = ({"role": "user", "content": user},)
            pool = cp.CODE_FOLLOW_UPS if r.kind == KINDS["code"] else cp.FOLLOW_UPS
            follow = pool[_hash(r.key + "/f") % len(pool)]
        answer = tok.decode(r.tokens[r.prompt_len :].tolist(), skip_special_tokens=True)
        messages = (*first, {"role": "assistant", "content": answer}, {"role": "user", "content": follow})
        kind = "code" if r.kind == KINDS["code"] else "chat"
        key = f"t2/{r.key}"
        out.append(Request(key, kind, messages, _mode(key)))
    return out


# ------------------------------------------------------------------------------------------ train


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def head_tokens(records: list[Record], size: int, eos: int) -> torch.Tensor:
    """The ``size`` tokens the target emits most in its answers (EOS always), sorted."""
    counts = np.zeros(1 << 16, dtype=np.int64)
    for r in records:
        np.add.at(counts, r.tokens[r.prompt_len :].astype(np.int64), 1)
    counts[eos] += 1 << 40
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.sort(torch.as_tensor(top, dtype=torch.long)).values


def subset(records: list[Record], fraction: float) -> list[Record]:
    """A nested share of the records (the first ``fraction`` in a fixed hash order)."""
    ordered = sorted(records, key=lambda r: _hash(r.key))
    return ordered[: max(1, round(len(ordered) * fraction))]


class Batches:
    """Random batches of conversations (their last ``max_len`` tokens), about ``tokens`` tokens each."""

    def __init__(self, records: list[Record], max_len: int, tokens: int, seed: int) -> None:
        self.records = records
        self.max_len = max_len
        self.tokens = tokens
        self.rng = random.Random(seed)

    def sample(self) -> list[Record]:
        out, longest = [], 0
        while True:
            r = self.records[self.rng.randrange(len(self.records))]
            n = min(len(r.tokens), self.max_len)
            if out and max(longest, n) * (len(out) + 1) > self.tokens:
                return out
            out.append(r)
            longest = max(longest, n)

    def tensors(self, records: list[Record], device: torch.device):
        """ids [B, T], attention mask [B, T], loss mask [B, T-1] (slot j predicts an answer token j+1)."""
        width = max(min(len(r.tokens), self.max_len) for r in records)
        ids = torch.zeros((len(records), width), dtype=torch.long)
        mask = torch.zeros((len(records), width), dtype=torch.long)
        loss = torch.zeros((len(records), width), dtype=torch.bool)
        for b, r in enumerate(records):
            start = max(0, len(r.tokens) - self.max_len)
            seq = torch.as_tensor(r.tokens[start:].astype(np.int64))
            ids[b, : len(seq)] = seq
            mask[b, : len(seq)] = 1
            first = max(r.prompt_len - start, 1)  # the first answer token's index in the window
            loss[b, first : len(seq)] = True  # token t is an answer token
        # Slot j (ids index j, j >= 1) predicts token j + 1: its loss flag is loss[:, j + 1].
        slot_loss = torch.zeros_like(loss)
        slot_loss[:, :-1] = loss[:, 1:]
        return ids.to(device), mask.to(device), slot_loss[:, 1:].to(device)


@torch.no_grad()
def target_pass(target, ids, mask, head_ids, eps):
    """Features ``[B, T, d]`` float32 and head-token logits ``[B, T, H]`` float32 at every position."""
    with FinalNormInput(target) as tap:
        normed = target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, d]
    feats = target_features(tap.hidden, eps)
    rows = target.get_output_embeddings().weight[head_ids]  # [H, d]
    return feats, torch.nn.functional.linear(normed, rows).float()


def head_losses(head: FeatureHead, ids, feats, tlogits, slot_loss, steps: int, args):
    """Loss and per-step statistics of the unrolled head on one batch (see the module docstring)."""
    x = ids[:, 1:]  # slot tokens x_1 .. x_{T-1}
    f_in = feats[:, :-1]  # f_0 .. f_{T-2}
    f_out = feats[:, 1:]  # what slot j estimates: f_j
    p_logits = tlogits[:, 1:]  # slot j's target: the target's distribution of token j + 1
    p = torch.softmax(p_logits, dim=-1)
    logp = torch.log_softmax(p_logits, dim=-1)
    top = p_logits.argmax(-1)
    outs = head.unrolled(x, f_in, steps)
    total = torch.zeros((), device=ids.device)
    stats = []
    for k, out in enumerate(outs, start=1):
        valid = slot_loss.clone()
        valid[:, : k - 1] = False  # slots whose chain would start before slot 1
        n = valid.sum().clamp_min(1)
        logq = torch.log_softmax(out.logits, dim=-1)
        kl = ((p * (logp - logq)).sum(-1) * valid).sum() / n
        ce = (-(logq.gather(-1, top[..., None])[..., 0]) * valid).sum() / n
        reg = (torch.nn.functional.smooth_l1_loss(out.hidden.float(), f_out, reduction="none").mean(-1) * valid).sum() / n
        weight = args.step_decay ** (k - 1)
        total = total + weight * (kl + args.ce_weight * ce + args.reg_weight * reg)
        agree = (out.logits.argmax(-1) == top) & valid
        stats.append({"kl": float(kl.detach()), "ce": float(ce.detach()), "reg": float(reg.detach()),
                      "top1": float(agree.sum() / n)})
    return total, stats


@torch.no_grad()
def evaluate(head: FeatureHead, target, records: list[Record], args, device) -> dict:
    """Held-out greedy replay, per kind: for rounds starting at every answer slot ``m`` (its token
    ``m + 1`` is an answer token), the share whose step-``k`` draft is the target's greedy token, and
    the mean accepted draft tokens per round at gamma ``1 .. unroll`` (drafts accepted while each
    equals the target's greedy answer, which is the greedy answer's own next token)."""
    head.eval()
    result = {}
    for kind, code in KINDS.items():
        rs = [r for r in records if r.kind == code]
        if not rs:
            continue
        hits = torch.zeros(args.unroll, dtype=torch.float64)
        tried = torch.zeros(args.unroll, dtype=torch.float64)
        accepted = torch.zeros(args.unroll, dtype=torch.float64)
        rounds = 0
        shaper = Batches(rs, args.max_len, args.batch_tokens, 0)
        for i in range(0, len(rs), 8):
            ids, mask, slot_loss = shaper.tensors(rs[i : i + 8], device)
            with _autocast(device):
                feats, _ = target_pass(target, ids, mask, head.head_token_ids, target.config.rms_norm_eps)
                outs = head.unrolled(ids[:, 1:], feats[:, :-1], args.unroll)
            starts = slot_loss[:, :-1]  # [B, S-1]: slot m predicts answer token m + 2 (ids index), labelled
            label = _slot_of(head, ids[:, 2:])  # [B, S-1]
            n = starts.shape[1]
            chain = None
            for k, out in enumerate(outs, start=1):
                hit = (out.logits[:, :n].argmax(-1) == label) & starts  # at slot j
                at_start = torch.zeros_like(hit)  # step k of the round from m sits at slot m + k - 1
                at_start[:, : n - (k - 1)] = hit[:, k - 1 :]
                labelled = torch.zeros_like(hit)
                labelled[:, : n - (k - 1)] = starts[:, k - 1 :]
                chain = at_start if chain is None else chain & at_start
                hits[k - 1] += float((at_start & starts & labelled).sum())
                tried[k - 1] += float((starts & labelled).sum())
                accepted[k - 1] += float((chain & starts).sum())
            rounds += int(starts.sum())
        per_gamma = torch.cumsum(accepted, 0) / max(rounds, 1)
        result[kind] = {
            "top1_per_step": [round(float(h / max(t, 1)), 4) for h, t in zip(hits, tried, strict=True)],
            "accepted_per_round": {str(g): round(float(per_gamma[g - 1]), 4) for g in range(1, args.unroll + 1)},
            "rounds": rounds,
        }
    head.train()
    return result


def _slot_of(head: FeatureHead, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids -> index in the head (-1 outside it)."""
    slot = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=tokens.device)
    slot[head.head_token_ids] = torch.arange(head.config.head_size, device=tokens.device)
    return slot[tokens]


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def train(args: argparse.Namespace) -> None:
    device = _device(args.device)
    torch.manual_seed(args.seed)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    records = [r for prefix in ("turn1", "turn2", "selfinstruct", "turn2si") for r in load_records(args.data, prefix)]
    heldout = load_records(args.data, "heldout")
    if not records:
        raise SystemExit(f"no training data in {args.data}: run the generate stage first")
    eos = target.config.eos_token_id
    ids = head_tokens(records, args.head_size, eos)
    chosen = subset(records, args.fraction)
    n_tokens = sum(len(r.tokens) - r.prompt_len for r in chosen)
    head = head_from_target(target, ids, target_model=args.target_name).to(device)
    head.attach_target(target.get_input_embeddings().weight.float())
    params = [p for n, p in head.named_parameters() if p.requires_grad and not n.startswith("norm.")]
    head.norm.weight.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = out_dir / "checkpoint.pt"
    state = {"step": 0, "history": [], "elapsed_s": 0.0}
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']}")
    batches = Batches(chosen, args.max_len, args.batch_tokens, args.seed + state["step"])
    deadline = time.monotonic() + (args.time_budget or float("inf"))
    total_steps = args.train_steps
    started = time.monotonic() - state["elapsed_s"]
    bar = _tqdm()(initial=state["step"], total=total_steps, desc=f"train {args.fraction:g}", unit="step")

    def save(final: bool = False) -> None:
        state["elapsed_s"] = time.monotonic() - started
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").rename(ckpt)
        meta = {
            "fraction": args.fraction,
            "records": len(chosen),
            "answer_tokens": n_tokens,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **state,
        }
        (out_dir / "train_meta.json").write_text(json.dumps(meta, indent=1))

    while state["step"] < total_steps and time.monotonic() < deadline - args.eval_reserve:
        step = state["step"]
        progress = step / total_steps
        if args.time_budget:
            progress = max(progress, (time.monotonic() - started) / args.time_budget)
        lr = _lr(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        ids_b, mask_b, slot_loss = batches.tensors(batches.sample(), device)
        with _autocast(device):
            feats, tlogits = target_pass(target, ids_b, mask_b, head.head_token_ids, target.config.rms_norm_eps)
            loss, stats = head_losses(head, ids_b, feats, tlogits, slot_loss, args.unroll, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}", top1=f"{stats[0]['top1']:.3f}", top1_4=f"{stats[-1]['top1']:.3f}")
        if state["step"] % args.log_every == 0 or state["step"] == total_steps:
            entry = {"step": state["step"], "time_s": round(time.monotonic() - started, 1), "loss": float(loss),
                     "train": stats}
            if state["step"] % args.eval_every == 0 or state["step"] == total_steps:
                entry["heldout"] = evaluate(head, target, heldout, args, device)
            state["history"].append(entry)
            print(json.dumps(entry), flush=True)
        if state["step"] % args.checkpoint_every == 0:
            save()
    if not state["history"] or "heldout" not in state["history"][-1]:
        state["history"].append({"step": state["step"], "time_s": round(time.monotonic() - started, 1),
                                 "heldout": evaluate(head, target, heldout, args, device)})
    save(final=True)
    export_weights(head, out_dir / "head.safetensors")


def _lr(step: int, progress: float, args) -> float:
    """Linear warm-up over ``--warmup`` steps, then a cosine from ``--lr`` to a tenth of it as ``progress``
    (the larger of steps done / ``--train-steps`` and seconds spent / ``--time-budget``) goes to 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def export_weights(head: FeatureHead, path: Path) -> None:
    """The head's own tensors (not the target's tables), float16, with its config in the metadata."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(path), metadata={"config": head.config.to_json_string()})


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("generate", "train"))
    ap.add_argument("--target", default=str(Path.home() / ".cache/specserve/models/smollm2-135m-instruct"))
    ap.add_argument("--target-name", default="smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=DEFAULT_WORK / "full")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; stop starting work after this")
    # generate
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=288)
    ap.add_argument("--heldout-tokens", type=int, default=128)
    ap.add_argument("--questions", type=int, default=8, help="self-instruct samples per subject and meta-prompt")
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests per phase (smoke runs)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--worker", type=int, default=0)
    # train
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--head-size", type=int, default=8192)
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--reg-weight", type=float, default=1.0)
    ap.add_argument("--step-decay", type=float, default=0.8)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-reserve", type=float, default=0.0, help="seconds of --time-budget kept for the last evaluation")
    args = ap.parse_args(argv)
    if args.stage == "generate":
        generate(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
