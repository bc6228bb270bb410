"""The target alone outside the service: Hugging Face ``generate()``, stock transformers, float32.

What a user without specserve runs, so what the demo's speedups are against (docs/benchmarks/history.md
has the speed gate's figures for the same comparison). Loaded in the launcher's process, which idles
while the stack's processes serve, and run while they idle.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: How the demo names this baseline.
NAME = "HF generate()"
LONG_NAME = "Hugging Face generate() of the target alone (stock transformers, float32, this process)"


@dataclass(frozen=True)
class Baseline:
    """One generation of the target alone: its tokens and the seconds it took, prefill included."""

    token_ids: tuple[int, ...]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class TargetAlone:
    """The target model as stock transformers loads it, generating through its own chat template."""

    def __init__(self, target_dir: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=torch.float32)
        self.model.eval()

    def chat(
        self, messages: Sequence[dict[str, str]], *, max_new_tokens: int, temperature: float, seed: int | None
    ) -> Baseline:
        torch = self._torch
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed or 0)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - start
        return Baseline(tuple(out[0, ids.shape[1] :].tolist()), seconds)
