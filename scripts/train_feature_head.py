"""Train the feature-conditioned draft head (``specserve.engine.feature_head``) on the target's own answers.

Stages (each resumable; CUDA when present, else the CPU)::

    python scripts/train_feature_head.py generate   # the target answers many prompts -> token ids (data/)
    python scripts/train_feature_head.py train      # the head, on features recomputed from those ids
    python scripts/train_feature_head.py export     # the head's model directory in models/
    python scripts/train_feature_head.py stats      # what the data holds, by phase (a Markdown table)

``generate`` keeps token ids only (``data/smollm2-answers/*.npz.xz``, a few MB in
the repository): the target's features and distributions are recomputed from
them by one forward pass when training, so data accumulates across machines.
The prompts (``specserve.prompts.chat``; held-out subjects never appear):

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
import itertools
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

from specserve.engine.feature_head import (  # noqa: E402
    FeatureHead,
    FinalNormInput,
    LayerOutputs,
    default_fused_layers,
    head_from_target,
    load_feature_head,
    save_feature_head,
    target_features,
)
from specserve.prompts import chat as cp  # noqa: E402

DEFAULT_DATA = ROOT / "data" / "smollm2-answers"
DEFAULT_WORK = Path(os.environ.get("SPECSERVE_HEAD_DIR", Path.home() / ".cache" / "specserve" / "feature-head"))
KINDS = {"chat": 0, "code": 1}
MODES = {"greedy": 0, "t0.7": 1, "t1.0": 2, "text": 3}  # text: fixed text, teacher-forced (the ``text`` stage)


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
    shard: str = ""  # the shard's name ("turn1-00003"): its features file is <features>/<shard>.npy
    start: int = 0  # this record's first row in that file


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
    shard = path.name.removesuffix(".npz.xz")
    with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as z:
        tokens, lengths = z["tokens"], z["lengths"]
        keys = str(z["keys"]).split("\n")
        out, start = [], 0
        for i, n in enumerate(lengths):
            out.append(
                Record(keys[i], tokens[start : start + n], int(z["prompt_lens"][i]), int(z["kinds"][i]),
                       int(z["modes"][i]), shard, start)
            )
            start += int(n)
    return out


def load_records(folder: Path, prefix: str, shards: int | None = None) -> list[Record]:
    """The records of the phase's shards (the first ``shards`` of them in name order; None: all)."""
    out: list[Record] = []
    for path in sorted(folder.glob(f"{prefix}-*.npz.xz"))[:shards]:
        out += load_shard(path)
    return out


def training_records(args: argparse.Namespace) -> list[Record]:
    """The training phases' records (``--shards``: the first N shards of each phase), then the fixed text's
    (``--text``: the ``text`` stage's shards, ``--text-shards`` of them)."""
    records = [r for prefix in TRAIN_PHASES for r in load_records(args.data, prefix, args.shards)]
    if args.text is not None:
        records += load_records(args.text, "text", args.text_shards)
    return records


def save_features(path: Path, per_record: list[np.ndarray], hidden: int) -> None:
    """A shard's features: every record's rows (one per token; its last token's row is zeros), float16. A row is
    ``[hidden]``, or ``[layers, hidden]`` for fused features (the ``--feature fused`` features stage)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blocks = []
    for f in per_record:
        blocks += [f.astype(np.float16), np.zeros((1, *f.shape[1:]), dtype=np.float16)]
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, np.concatenate(blocks))
    tmp.rename(path)


class FeatureFiles:
    """The cached features of the shards, memory-mapped; a record's rows are ``[len, hidden]``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._open: dict[str, np.ndarray] = {}

    def missing(self, records: list[Record]) -> list[str]:
        return sorted({r.shard for r in records if not (self.folder / f"{r.shard}.npy").exists()})

    def of(self, r: Record) -> np.ndarray:
        if r.shard not in self._open:
            self._open[r.shard] = np.load(self.folder / f"{r.shard}.npy", mmap_mode="r")
        return self._open[r.shard][r.start : r.start + len(r.tokens)]


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


def heldout_requests(per_kind: int) -> list[Request]:
    return [
        Request(f"{p.name}#heldout", p.kind, p.messages, "greedy")
        for kind in ("chat", "code")
        for p in cp.heldout_prompts(kind, per_kind)
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


_HELDOUT_WORDS: list[str] | None = None


def names_heldout(text: str) -> bool:
    """Whether ``text`` names a held-out subject (which no training phase may)."""
    global _HELDOUT_WORDS
    if _HELDOUT_WORDS is None:
        subjects = []
        for block in (cp.TOPICS, cp.TASKS, cp.CODE_TASKS, cp.CODE_CONCEPTS):
            subjects += [s.lower() for s in cp._items(block) if cp.is_heldout(s)]
        _HELDOUT_WORDS = subjects
    low = text.lower()
    return any(s in low for s in _HELDOUT_WORDS)


def clean_question(text: str) -> str | None:
    """The question in a meta-prompt's answer, or None when it is unusable (or names a held-out subject)."""
    quoted = re.findall(r'"([^"]{15,400})"', text)
    text = max(quoted, key=len) if quoted else text.strip().split("\n")[0]
    text = re.sub(r"^(question|request|exercise|task)\s*:\s*", "", text.strip(), flags=re.I).strip()
    if not 15 <= len(text) <= 400 or "<|" in text or len(text.split()) < 3 or text[-1] not in "?.":
        return None
    if names_heldout(text):
        return None
    return text


# ------------------------------------------------------------------------------------------ generate


def _load_target(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok


class _AllFinalNormInputs(FinalNormInput):
    """Every input of the final norm during ``generate``: the prefill's, then one position per step."""

    def __enter__(self) -> _AllFinalNormInputs:
        self.calls: list[torch.Tensor] = []

        def hook(_module, args):
            self.calls.append(args[0].detach())

        self._handle = self.norm.register_forward_pre_hook(hook)
        return self


def _answer(model, tok, requests: list[Request], max_new: int, seed: int):
    """(prompt ids, completion ids, features [len - 1, hidden] float16) per request, all of one mode, in one
    ``generate`` call. The features are the target's (:func:`target_features`) at every position but the
    last, captured from the passes ``generate`` makes anyway."""
    texts = [tok.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=False) for r in requests]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    mode = requests[0].mode
    sampling = {"do_sample": False}
    if mode != "greedy":
        sampling = {"do_sample": True, "temperature": float(mode[1:]), "top_k": 0, "top_p": 1.0}
    torch.manual_seed(seed)
    eps = model.config.rms_norm_eps
    with torch.inference_mode(), _AllFinalNormInputs(model) as tap:
        out = model.generate(
            **enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sampling
        )
    width = enc["input_ids"].shape[1]
    steps = torch.cat([c[:, -1:] for c in tap.calls[1:]], dim=1) if len(tap.calls) > 1 else None  # [B, S-1, d]
    rows = []
    for b in range(len(requests)):
        real = enc["attention_mask"][b].bool()
        prompt = enc["input_ids"][b][real].tolist()
        completion = out[b, width:].tolist()
        if tok.eos_token_id in completion:
            completion = completion[: completion.index(tok.eos_token_id) + 1]
        else:
            while completion and completion[-1] == tok.pad_token_id:
                completion.pop()
        hidden = tap.calls[0][b, width - len(prompt) :]  # [P, d]
        if steps is not None:
            hidden = torch.cat([hidden, steps[b]], dim=0)
        hidden = hidden[: len(prompt) + len(completion) - 1]
        rows.append((prompt, completion, target_features(hidden, eps).to(torch.float16).cpu().numpy()))
    return rows


def _run_phase(args, model, tok, phase: str, requests: list[Request], max_new: int, deadline: float) -> int:
    """Answer ``requests`` in batches of one mode, a shard per batch; returns the answer tokens written."""
    per_mode = []
    for mode in MODES:
        chosen = sorted((r for r in requests if r.mode == mode), key=lambda r: (len(json.dumps(r.messages)), r.key))
        per_mode.append([chosen[i : i + args.batch_size] for i in range(0, len(chosen), args.batch_size)])
    # The modes take turns, so that a run stopped early has some of each.
    batches = [b for turn in itertools.zip_longest(*per_mode) for b in turn if b is not None]
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
            for r, (p, c, _) in zip(batch, rows, strict=True)
        ]
        save_features(args.features / f"{phase}-{index:05d}.npy", [f for _, _, f in rows], model.config.hidden_size)
        save_shard(path, records)
        written += sum(len(c) for _, c, _ in rows)
        bar.set_postfix(tokens=written)
    return written


def generate(args: argparse.Namespace) -> None:
    device = _device(args.device)
    dtype = getattr(torch, args.gen_dtype)
    args.data.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.time_budget or float("inf"))
    model, tok = _load_target(args.target, device, dtype)
    limit = (lambda xs: xs[: args.limit]) if args.limit else (lambda xs: xs)

    _run_phase(args, model, tok, "heldout", limit(heldout_requests(args.heldout_prompts)), args.heldout_tokens, deadline)
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


# ------------------------------------------------------------------------------------------ fixed text


def _stdlib_files() -> list[Path]:
    """The Python standard library's own modules (PSF licence), tests and bundled packages left out."""
    root = Path(os.__file__).parent
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _text_items(root: Path, path: Path) -> list[tuple[str, str, str, str]]:
    """(kind, key, user turn, assistant turn) of one module: each top-level function or class of 6-60 lines as
    code, and each docstring of 200-2,000 characters as prose about what it documents."""
    import ast
    import inspect

    source = path.read_text(errors="replace")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    lines = source.splitlines()
    out = []
    doc = ast.get_docstring(tree)
    if doc and 200 <= len(doc) <= 2000:
        out.append(("chat", f"text/doc/{module}", f"What is Python's `{module}` module for?", inspect.cleandoc(doc)))
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
            continue
        what = "class" if isinstance(node, ast.ClassDef) else "function"
        doc = ast.get_docstring(node)
        if doc and 200 <= len(doc) <= 2000:
            user = f"What does the {what} `{node.name}` in Python's `{module}` module do?"
            out.append(("chat", f"text/doc/{module}.{node.name}", user, inspect.cleandoc(doc)))
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        if node.end_lineno is not None and 6 <= node.end_lineno - start <= 60:
            code = "\n".join(lines[start : node.end_lineno])
            user = f"Write the Python {what} `{node.name}` of the `{module}` module."
            answer = f"Here is `{node.name}`:\n\n```python\n{code}\n```"
            out.append(("code", f"text/code/{module}.{node.name}", user, answer))
    return out


def text(args: argparse.Namespace) -> None:
    """Fixed text as conversations for teacher-forced training (``--text``): the standard library's functions and
    classes as code answers, its docstrings as prose answers, in random order, held-out subjects left out, up to
    ``--text-tokens`` answer tokens in shards of ``--batch-size``. The target answers nothing here: the features
    stage's one pass gives its distributions over this text (EAGLE-1's fixed-data training)."""
    from transformers import AutoTokenizer

    if args.text is None:
        raise SystemExit("pass --text, the folder the text shards go to")
    args.text.mkdir(parents=True, exist_ok=True)
    if any(args.text.glob("text-*.npz.xz")):
        print(f"{args.text} already holds text shards: nothing to do")
        return
    tok = AutoTokenizer.from_pretrained(args.target)
    root = Path(os.__file__).parent
    items = [item for path in _stdlib_files() for item in _text_items(root, path)]
    random.Random(args.seed).shuffle(items)
    records: list[Record] = []
    written = shards = 0
    bar = _tqdm()(total=args.text_tokens, desc="text", unit="tok")
    for kind, key, user, answer in items:
        if written >= args.text_tokens:
            break
        if names_heldout(user + answer):
            continue
        chat = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        prompt = tok(chat, add_special_tokens=False)["input_ids"]
        reply = tok(answer, add_special_tokens=False)["input_ids"][: args.max_new_tokens]
        if len(reply) < args.max_new_tokens:
            reply.append(tok.eos_token_id)
        records.append(Record(key, np.array(prompt + reply, dtype=np.uint16), len(prompt), KINDS[kind], MODES["text"]))
        written += len(reply)
        bar.update(len(reply))
        if len(records) == args.batch_size:
            save_shard(args.text / f"text-{shards:05d}.npz.xz", records)
            records, shards = [], shards + 1
    if records:
        save_shard(args.text / f"text-{shards:05d}.npz.xz", records)
    print(f"{written:,} answer tokens of fixed text in {args.text}")


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

    def __init__(self, records: list[Record], features: FeatureFiles, max_len: int, tokens: int, seed: int) -> None:
        self.records = records
        self.features = features
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
        """ids ``[B, T]``, features ``[B, T, d]`` (fused: ``[B, T, layers, d]``) float32, and the slots' loss mask
        ``[B, T - 1]``: slot ``j`` (ids index ``j >= 1``) counts when the token it predicts, ``j + 1``, is an
        answer token."""
        width = max(min(len(r.tokens), self.max_len) for r in records)
        row_shape = self.features.of(records[0]).shape[1:]
        ids = torch.zeros((len(records), width), dtype=torch.long)
        feats = torch.zeros((len(records), width, *row_shape), dtype=torch.float32)
        answer = torch.zeros((len(records), width), dtype=torch.bool)
        for b, r in enumerate(records):
            start = max(0, len(r.tokens) - self.max_len)
            seq = torch.as_tensor(r.tokens[start:].astype(np.int64))
            ids[b, : len(seq)] = seq
            feats[b, : len(seq)] = torch.from_numpy(np.asarray(self.features.of(r)[start:], dtype=np.float32))
            answer[b, max(r.prompt_len - start, 1) : len(seq)] = True
        slot_loss = torch.zeros_like(answer)
        slot_loss[:, :-1] = answer[:, 1:]
        return ids.to(device), feats.to(device), slot_loss[:, 1:].to(device)


def target_logits(head: FeatureHead, feats: torch.Tensor) -> torch.Tensor:
    """The target's logits over the head's tokens from its features: ``norm(h) = f * w`` (``f = h / rms(h)``),
    so ``[..., d] -> [..., head_size]`` float32, exactly the target's own rows of its head."""
    return torch.nn.functional.linear(feats * head.norm.weight.float(), head.head_rows.float())


def head_inputs(head: FeatureHead, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's input features, the last layer's features) of cached rows ``[..., d]`` or ``[..., layers, d]``:
    a fused head's inputs are ``fuse``'s projection; the target's distributions come from the last layer's. A
    last-layer head reads the last layer of fused rows (one features cache serves both kinds of head)."""
    if head.fuse is None:
        last = feats[..., -1, :] if feats.dim() == 4 else feats
        return last, last
    return head.fused(feats, head.config.rms_norm_eps), feats[..., -1, :]


def head_losses(head: FeatureHead, ids, feats, slot_loss, steps: int, args):
    """Loss and per-step statistics of the unrolled head on one batch (see the module docstring). The
    output head runs at the slots a loss reads only (the answer's; prompt slots feed attention alone)."""
    x = ids[:, 1:]  # slot tokens x_1 .. x_{T-1}
    inputs, last = head_inputs(head, feats)
    f_in = inputs[:, :-1]  # f_0 .. f_{T-2}
    f_out = last[:, 1:]  # what slot j's distribution is the target's from: f_j
    reg_of = inputs[:, 1:].detach()  # what slot j's output would regress on: the next slot's input feature
    outs = head.unrolled(x, f_in, steps, logits=False)
    total = torch.zeros((), device=ids.device)
    stats = []
    for k, out in enumerate(outs, start=1):
        valid = slot_loss.clone()
        valid[:, : k - 1] = False  # slots whose chain would start before slot 1
        n = valid.sum().clamp_min(1)
        target = f_out[valid]  # [N, d]
        with torch.no_grad():
            p_logits = target_logits(head, target)  # the target's distribution of each slot's next token
            p = torch.softmax(p_logits, dim=-1)
            logp = torch.log_softmax(p_logits, dim=-1)
            top = p_logits.argmax(-1)
        hidden = out.hidden[valid]  # [N, d]
        logq = torch.log_softmax(head.head_logits(hidden), dim=-1)
        kl = (p * (logp - logq)).sum(-1).sum() / n
        ce = -logq.gather(-1, top[:, None]).sum() / n
        reg_target = reg_of[valid].float()
        reg = torch.nn.functional.smooth_l1_loss(hidden.float(), reg_target, reduction="sum") / (n * target.shape[-1])
        total = total + args.step_decay ** (k - 1) * (kl + args.ce_weight * ce + args.reg_weight * reg)
        agree = (logq.argmax(-1) == top).sum()
        stats.append(
            {"kl": float(kl.detach()), "ce": float(ce.detach()), "reg": float(reg.detach()),
             "top1": float(agree / n)}
        )
    return total, stats


@torch.no_grad()
def evaluate(head: FeatureHead, records: list[Record], features: FeatureFiles, args, device) -> dict:
    """Held-out greedy replay, per kind: for rounds starting at every slot ``m`` whose next token is an
    answer token, the share whose step-``k`` draft is the target's greedy token, and the mean accepted
    draft tokens per round at gamma ``1 .. unroll`` (drafts are accepted while each equals the greedy
    answer's own next token, which is the target's greedy choice)."""
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
        shaper = Batches(rs, features, args.max_len, args.batch_tokens, 0)
        for i in range(0, len(rs), 8):
            ids, feats, slot_loss = shaper.tensors(rs[i : i + 8], device)
            with _autocast(device):
                outs = head.unrolled(ids[:, 1:], head_inputs(head, feats)[0][:, :-1], args.unroll)
            starts = slot_loss[:, :-1]  # [B, S-1]: slot m predicts answer token (ids index) m + 2
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
    """bfloat16 autocast where bfloat16 matrices are fast (CUDA; CPUs with AVX-512 BF16 or AMX: about twice
    float32's speed), else none (an AVX2 CPU runs bfloat16 matrices several times slower than float32)."""
    from specserve.engine.kernel_choice import cpu_model_and_flags

    fast = device.type == "cuda" or bool({"avx512_bf16", "amx_bf16"} & set(cpu_model_and_flags()[1]))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast)


def features(args: argparse.Namespace) -> None:
    """Compute the features of every shard that has none cached: one target pass per conversation (``--feature
    fused``: the fused layers' states, each over its RMS, ``[len, layers, d]`` per record)."""
    device = _device(args.device)
    records = load_records(args.data, "heldout") + training_records(args)
    files = FeatureFiles(args.features)
    missing = files.missing(records)
    if not missing:
        return
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.feature_dtype)).to(device).eval()
    layers = fused_layers(args, target.config.num_hidden_layers)
    eps = target.config.rms_norm_eps
    by_shard: dict[str, list[Record]] = {}
    for r in records:
        by_shard.setdefault(r.shard, []).append(r)
    bar = _tqdm()(total=sum(len(r.tokens) for s in missing for r in by_shard[s]), desc="features", unit="tok")
    for shard in missing:
        rows = []
        for r in by_shard[shard]:
            ids = torch.as_tensor(r.tokens.astype(np.int64), device=device)[None]
            with torch.inference_mode():
                if layers is None:
                    with FinalNormInput(target) as tap:
                        target.get_decoder()(input_ids=ids[:, :-1])
                    state = tap.hidden[0]  # [len - 1, d]
                else:
                    with LayerOutputs(target, layers) as taps:
                        target.get_decoder()(input_ids=ids[:, :-1])
                    state = taps.stacked()[0]  # [len - 1, layers, d]
            rows.append(target_features(state, eps).half().cpu().numpy())
            bar.update(len(r.tokens))
        save_features(args.features / f"{shard}.npy", rows, target.config.hidden_size)


def fused_layers(args: argparse.Namespace, num_layers: int) -> list[int] | None:
    """The target layers of ``--feature fused`` (``--fused-layers``, else a low, a middle and the last), or None."""
    if args.feature != "fused":
        return None
    if args.fused_layers:
        return [int(x) for x in args.fused_layers.split(",")]
    return default_fused_layers(num_layers)


TRAIN_PHASES = ("turn1", "turn2", "selfinstruct", "turn2si")
#: Every phase, in the order ``generate`` runs them.
ALL_PHASES = ("heldout", "turn1", "turn2", "questions", "selfinstruct", "turn2si")


def train(args: argparse.Namespace) -> None:
    device = _device(args.device)
    torch.manual_seed(args.seed)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM

    records = training_records(args)
    heldout = load_records(args.data, "heldout")[: args.heldout_records]
    if not records:
        raise SystemExit(f"no training data in {args.data}: run the generate stage first")
    files = FeatureFiles(args.features)
    if files.missing(records + heldout):
        raise SystemExit(f"shards without features in {args.features}: run the features stage first")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    ids = head_tokens(records, args.head_size, target.config.eos_token_id)
    chosen = subset(records, args.fraction)
    n_tokens = sum(len(r.tokens) - r.prompt_len for r in chosen)
    layers = fused_layers(args, target.config.num_hidden_layers)
    head = head_from_target(target, ids, target_model=args.target_name, fused_layers=layers).to(device)
    del target
    if args.init is not None and not (out_dir / "checkpoint.pt").exists():
        _init_from(head, args.init, args.target, keep_tokens=args.keep_init_tokens)
    head.norm.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = out_dir / "checkpoint.pt"
    state = {"step": 0, "history": [], "elapsed_s": 0.0}
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        head.load_state_dict(saved["head"], strict=False)
        head.set_head_tokens(head.head_token_ids.clone())  # the checkpoint's tokens: their rows again
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']}", flush=True)
    pool = [r for r in chosen for _ in range(args.code_repeat if r.kind == KINDS["code"] else 1)]
    if args.epochs is not None:  # a fixed number of passes over the data: steps of about --batch-tokens tokens
        args.train_steps = max(1, math.ceil(args.epochs * sum(min(len(r.tokens), args.max_len) for r in pool)
                                            / args.batch_tokens))
        print(f"{args.epochs:g} epochs of {len(pool)} records: {args.train_steps} steps", flush=True)
    batches = Batches(pool, files, args.max_len, args.batch_tokens, args.seed + state["step"])
    deadline = time.monotonic() + (args.time_budget or float("inf"))
    started = time.monotonic() - state["elapsed_s"]
    bar = _tqdm()(initial=state["step"], total=args.train_steps, desc=f"train {args.fraction:g}", unit="step")

    def save() -> None:
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
        save_feature_head(head, out_dir / "head")

    def log(entry: dict) -> None:
        state["history"].append(entry)
        print(json.dumps(entry), flush=True)

    while state["step"] < args.train_steps and time.monotonic() < deadline - args.eval_reserve:
        step = state["step"]
        progress = step / args.train_steps
        if args.time_budget:
            progress = max(progress, (time.monotonic() - started) / args.time_budget)
        for g in opt.param_groups:
            g["lr"] = _lr(step, progress, args)
        ids_b, feats_b, slot_loss = batches.tensors(batches.sample(), device)
        with _autocast(device):
            loss, stats = head_losses(head, ids_b, feats_b, slot_loss, args.unroll, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{stats[0]['top1']:.3f}",
                        top1_last=f"{stats[-1]['top1']:.3f}")
        done = state["step"] == args.train_steps
        if state["step"] % args.log_every == 0 or done:
            entry = {"step": state["step"], "time_s": round(time.monotonic() - started, 1),
                     "loss": float(loss.detach()), "train": stats}
            if heldout and (state["step"] % args.eval_every == 0 or done):
                entry["heldout"] = evaluate(head, heldout, files, args, device)
            log(entry)
        if state["step"] % args.checkpoint_every == 0:
            save()
    if heldout and (not state["history"] or "heldout" not in state["history"][-1]):
        log({"step": state["step"], "time_s": round(time.monotonic() - started, 1),
             "heldout": evaluate(head, heldout, files, args, device)})
    save()


def _init_from(head: FeatureHead, directory: Path, target: str, *, keep_tokens: bool = False) -> None:
    """Start from an exported head's layer weights (``--init``); the head's tokens stay this run's unless
    ``keep_tokens`` (``--keep-init-tokens``: a fine-tune on a few shards, whose own most frequent tokens would
    replace rows the earlier head learned). A last-layer head's weights start a fused head (its ``fuse`` then
    passes the last layer through)."""
    earlier = load_feature_head(directory, target=target)  # checks that the files fit a head
    head.load_state_dict({k: v for k, v in earlier.state_dict().items() if k != "head_token_ids"}, strict=False)
    if keep_tokens:
        head.set_head_tokens(earlier.head_token_ids.clone())
    print(f"initialised from {directory}", flush=True)


def _lr(step: int, progress: float, args) -> float:
    """Linear warm-up over ``--warmup`` steps, then a cosine from ``--lr`` to a tenth of it as ``progress``
    (the larger of steps done / ``--train-steps`` and seconds spent / ``--time-budget``) goes to 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def export(args: argparse.Namespace) -> None:
    """Write the head of ``--out``'s last checkpoint to ``--export`` (float16, its config naming the target)
    with its training metadata beside it (``training_meta.json``: what the model card renders)."""
    from transformers import AutoModelForCausalLM

    ckpt = args.out / "checkpoint.pt"
    if not ckpt.exists():
        raise SystemExit(f"no checkpoint in {args.out}: run the train stage first")
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    fuse = saved["head"].get("fuse.weight")
    layers = fused_layers(args, target.config.num_hidden_layers) if fuse is not None else None
    if fuse is not None and layers is None:
        raise SystemExit("the checkpoint is a fused head: pass --feature fused (and its --fused-layers)")
    head = head_from_target(target, saved["head"]["head_token_ids"], target_model=args.target_name, fused_layers=layers)
    head.load_state_dict(saved["head"], strict=False)
    save_feature_head(head, args.export)
    meta = json.loads((args.out / "train_meta.json").read_text())
    (args.export / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.export}")


def stats(args: argparse.Namespace) -> None:
    """Print what ``--data`` holds, by phase: shards, answers, answer tokens, the code share and the
    sampled share (a Markdown table; the data README's)."""
    phases = sorted({p.name.split("-")[0] for p in args.data.glob("*.npz.xz")},
                    key=lambda ph: (ALL_PHASES.index(ph) if ph in ALL_PHASES else len(ALL_PHASES), ph))
    rows = ["| phase | trained on | shards | answers | answer tokens | code tokens | sampled tokens |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    totals = [0, 0, 0, 0, 0]
    for phase in phases:
        shards = len(list(args.data.glob(f"{phase}-*.npz.xz")))
        records = load_records(args.data, phase)
        answer = [len(r.tokens) - r.prompt_len for r in records]
        code = sum(n for r, n in zip(records, answer, strict=True) if r.kind == KINDS["code"])
        sampled = sum(n for r, n in zip(records, answer, strict=True) if r.mode != MODES["greedy"])
        figures = [shards, len(records), sum(answer), code, sampled]
        if phase in TRAIN_PHASES:
            totals = [t + f for t, f in zip(totals, figures, strict=True)]
        trained = "yes" if phase in TRAIN_PHASES else "no"
        rows.append(f"| {phase} | {trained} | " + " | ".join(f"{f:,}" for f in figures) + " |")
    rows.append("| **training phases** | | " + " | ".join(f"**{t:,}**" for t in totals) + " |")
    print("\n".join(rows))


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("generate", "text", "features", "train", "export", "stats"))
    ap.add_argument("--target", default=str(Path.home() / ".cache/specserve/models/smollm2-135m-instruct"))
    ap.add_argument("--target-name", default="smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--features", type=Path, default=DEFAULT_WORK / "features", help="the features' cache")
    ap.add_argument("--out", type=Path, default=DEFAULT_WORK / "full", help="the training run's directory")
    ap.add_argument(
        "--export", type=Path, default=ROOT / "specserve" / "models" / "specserve-smollm2-head",
        help="where the export stage writes the head",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; stop starting work after this")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    # generate
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--gen-dtype", default="bfloat16", help="the target's dtype while it answers")
    ap.add_argument("--max-new-tokens", type=int, default=288)
    ap.add_argument("--heldout-tokens", type=int, default=128)
    ap.add_argument("--heldout-prompts", type=int, default=40, help="held-out prompts per kind (the evaluation set)")
    ap.add_argument("--questions", type=int, default=8, help="self-instruct samples per subject and meta-prompt")
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests per phase (smoke runs)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--worker", type=int, default=0)
    # text
    ap.add_argument("--text", type=Path, default=None, help="fixed text's shards (the text stage's; trained on too)")
    ap.add_argument("--text-shards", type=int, default=None, help="use the first N shards of --text")
    ap.add_argument("--text-tokens", type=int, default=400_000, help="the text stage's answer tokens")
    # features
    ap.add_argument("--feature", choices=("last", "fused"), default="last",
                    help="last: the last layer's feature (EAGLE-1); fused: a low, a mid and the last layer (EAGLE-3)")
    ap.add_argument("--fused-layers", default=None, help="comma-separated target layers of --feature fused")
    ap.add_argument("--feature-dtype", default="bfloat16", help="the target's dtype while it computes features")
    ap.add_argument("--shards", type=int, default=None, help="use the first N shards of each training phase")
    # train
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--heldout-records", type=int, default=None, help="evaluate on the first N held-out answers")
    ap.add_argument("--init", type=Path, default=None, help="start from this exported head's weights (a new run only)")
    ap.add_argument("--keep-init-tokens", action="store_true", help="keep --init's head tokens (a fine-tune)")
    ap.add_argument("--code-repeat", type=int, default=1, help="sample each code record this many times as often")
    ap.add_argument("--head-size", type=int, default=8192)
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=2000)
    ap.add_argument("--epochs", type=float, default=None, help="train this many passes over the data (sets the steps)")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    stages = {"generate": generate, "text": text, "features": features, "train": train, "export": export,
              "stats": stats}
    stages[args.stage](args)


if __name__ == "__main__":
    main()
