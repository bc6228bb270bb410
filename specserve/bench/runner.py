"""What every ``specserve bench`` run shares: the header its JSON starts with, the pair resolved to directories,
a private Redis, and writing ``<out>/<name>.json`` with its Markdown (docs/benchmarks).
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.bench import markdown as md
from specserve.bench.options import Options, PairOptions


@dataclass
class Machine:
    """Where a run measured."""

    platform: str
    processor: str
    cpus: int
    torch: str
    python: str

    @classmethod
    def here(cls) -> Machine:
        return cls(
            platform=platform.platform(),
            processor=platform.processor(),
            cpus=torch.get_num_threads(),
            torch=torch.__version__,
            python=platform.python_version(),
        )


@dataclass
class Header:
    """What every benchmark's JSON starts with: the command, when, the machine, the pair (the target alone
    for a benchmark without a draft)."""

    command: str
    date_utc: str
    machine: Machine
    target: str
    draft: str | None = None

    @classmethod
    def of(cls, opts: Options) -> Header:
        draft = getattr(opts, "draft", None)
        return cls(opts.command, now_utc(), Machine.here(), str(getattr(opts, "target", "")), draft and str(draft))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.draft is None:
            del out["draft"]
        return out


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def resolve_pair(opts: PairOptions) -> None:
    """A registered name (fetched once into the cache), a directory or a hub id: from here on, a directory."""
    from specserve.engine.models import resolve_model_path

    opts.target = str(resolve_model_path(str(opts.target), "target"))
    opts.draft = str(resolve_model_path(str(opts.draft), "draft"))


def head_overrides(opts: Any) -> dict[str, str]:
    """The draft's settings for the feature head ``opts.head`` names ('auto': the default pair's head when
    ``opts.draft`` is the default draft and the head is present; 'none': no head), given ``opts.target``."""
    from specserve.bench.options import DEFAULT_DRAFT
    from specserve.engine import model_registry
    from specserve.engine.models import resolve_model_path

    head = opts.head
    if head == "auto":
        source = model_registry.REGISTRY.get(model_registry.DEFAULT_HEAD)
        default_draft = Path(resolve_model_path(DEFAULT_DRAFT, "draft")) == Path(opts.draft)
        head = model_registry.DEFAULT_HEAD if default_draft and source is not None and source.present() else "none"
    return {"feature_head": head, "feature_head_target": opts.target} if head != "none" else {"feature_head": "none"}


def head_info(opts: Any) -> dict[str, Any] | None:
    """The served feature head (None: the draft serves none): its directory, the hidden size of its feature
    rows, and its step over a target step as its card measured (``card.json`` beside it; None without one),
    what :mod:`specserve.bench.head_projection` projects from."""
    import json

    from specserve.engine.model_registry import resolve_model

    head = head_overrides(opts)["feature_head"]
    if head == "none":
        return None
    path = Path(resolve_model(head, progress=False))
    card = path / "card.json"
    ratio = json.loads(card.read_text())["costs"]["head_over_target_step"] if card.is_file() else None
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    return {"head": str(path), "hidden": hidden, "head_over_target_step": ratio}


def head_gamma_or_reason(opts: Any, info: dict[str, Any] | None) -> int | None:
    """``opts.head_gamma`` where the draft serves a head, else None with the reason printed."""
    if info is None:
        print(f"the feature head's mode is left out: the draft {opts.draft} serves no head (--head {opts.head})")
        return None
    return int(opts.head_gamma)


def stack_of(opts: PairOptions) -> dict[str, Any]:
    """The pair and the Redis a mode's ``measure`` starts its stacks with (``target``, ``draft``, ``redis_url``)."""
    return {"target": Path(opts.target), "draft": Path(opts.draft), "redis_url": opts.redis_url}


def run_mode(
    opts: PairOptions,
    measure: Callable[[Any], Awaitable[dict[str, Any]]],
    name: str,
    write: Callable[[dict[str, Any], Path], Path | list[Path]],
) -> int:
    """Measure through a stack (``measure(opts)``, with a private Redis unless ``--redis-url``), then write
    ``<out>/<name>.json`` (with the machine's load average before and after, ``load_average``: the machine
    may be shared) and what ``write(data, out)`` renders from it."""
    from specserve.launch.redis_server import private_redis
    from specserve.runtime.logs import configure_logging

    torch.set_num_threads(max(1, torch.get_num_threads()))
    resolve_pair(opts)
    configure_logging("console", "warning")  # per-round debug events would be timed too

    async def go() -> dict[str, Any]:
        with private_redis(opts.redis_url) as url:
            opts.redis_url = url
            return await measure(opts)

    before = os.getloadavg()
    data = asyncio.run(go())
    data["load_average"] = {"before": list(before), "after": list(os.getloadavg()), "cpus": os.cpu_count()}
    raw = md.write_json(opts.out / f"{name}.json", data)
    print(f"wrote {raw} and {write(data, opts.out)}")
    return 0


def code_prompts_for(opts: Any, tokenizer: Any, n: int) -> tuple[list[tuple[str, list[int]]], bool]:
    """``n`` held-out code prompts as (name, token ids), and whether they are held out: the held-out code
    requests through the chat template for a chat pair, else cuts of held-out stdlib files."""
    from specserve.bench.prompts import code_prompts, heldout_files, load_prompt_sets

    if getattr(tokenizer, "chat_template", None):
        sets = load_prompt_sets(["chat-code"], tokenizer, opts.target, n, opts.prompt_chars)
        return sets["chat-code"], True
    files, heldout_ok = heldout_files(Path(opts.target))
    cuts = code_prompts(files, n, max_chars=opts.prompt_chars)
    return [(p.name, tokenizer(p.text).input_ids) for p in cuts], heldout_ok
