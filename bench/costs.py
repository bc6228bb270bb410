"""Model-level costs on this machine: one decode step of each model, and one
target pass over k positions (what verifying k - 1 draft tokens costs), all
with a warm KV cache, batch 1, float32. Medians of ``repeats`` timings."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Costs:
    target_step_ms: float
    draft_step_ms: float
    #: verify_ms[k - 1]: one target pass over k positions (k = gamma + 1)
    verify_ms: list[float]

    @property
    def draft_to_target(self) -> float:
        return self.draft_step_ms / self.target_step_ms


def _prefilled(model, length: int):
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def _time_pass(model, cache, k: int, repeats: int) -> float:
    times = []
    ids = torch.randint(0, model.config.vocab_size, (1, k))
    with torch.inference_mode():
        for _ in range(repeats + 3):
            start = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-k)
    return 1000.0 * statistics.median(times[3:])


def measure_costs(target, draft, *, context: int = 128, max_k: int = 9, repeats: int = 50) -> Costs:
    t_cache = _prefilled(target, context)
    d_cache = _prefilled(draft, context)
    verify = [_time_pass(target, t_cache, k, repeats) for k in range(1, max_k + 1)]
    return Costs(
        target_step_ms=verify[0], draft_step_ms=_time_pass(draft, d_cache, 1, repeats), verify_ms=verify
    )


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected committed tokens of a round with i.i.d. acceptance alpha: (1 - a^(g+1)) / (1 - a)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, costs: Costs) -> float:
    """Cost-model bound: tokens per round x target step / (gamma draft steps + one verify pass)."""
    round_ms = gamma * costs.draft_step_ms + costs.verify_ms[gamma]
    return expected_tokens(alpha, gamma) * costs.target_step_ms / round_ms
