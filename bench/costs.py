"""Model-level costs on this machine: one decode step of each model, and one
target pass over k positions (what verifying k - 1 draft tokens costs), all
with a warm KV cache, batch 1, float32. Medians of ``repeats`` timings.

The speculation bound these costs predict is the coordinator's own cost model
(:func:`coordinator.cost_model.predicted_speedup`), not a copy of it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.pair import forward, prefilled
from coordinator.cost_model import predicted_speedup as cost_model_speedup


@dataclass
class Costs:
    target_step_ms: float
    draft_step_ms: float
    #: verify_ms[k - 1]: one target pass over k positions (k = gamma + 1)
    verify_ms: list[float]

    @property
    def draft_to_target(self) -> float:
        return self.draft_step_ms / self.target_step_ms


def random_context(model, length: int):
    return prefilled(model, torch.randint(0, model.config.vocab_size, (length,)).tolist())


def time_pass(model, cache, k: int, repeats: int) -> float:
    times = []
    ids = torch.randint(0, model.config.vocab_size, (k,)).tolist()
    with torch.inference_mode():
        for _ in range(repeats + 3):
            start = time.perf_counter()
            forward(model, ids, cache)
            times.append(time.perf_counter() - start)
            cache.crop(-k)
    return 1000.0 * statistics.median(times[3:])


def measure_costs(target, draft, *, context: int = 128, max_k: int = 9, repeats: int = 50) -> Costs:
    t_cache = random_context(target, context)
    d_cache = random_context(draft, context)
    verify = [time_pass(target, t_cache, k, repeats) for k in range(1, max_k + 1)]
    return Costs(
        target_step_ms=verify[0], draft_step_ms=time_pass(draft, d_cache, 1, repeats), verify_ms=verify
    )


def predicted_speedup(alpha: float, gamma: int, costs: Costs) -> float:
    """The cost model's bound with these measured costs (``T_verify(k) = verify_ms[k - 1]``)."""
    return cost_model_speedup(
        alpha, gamma, costs.draft_step_ms, lambda k: costs.verify_ms[k - 1], costs.target_step_ms
    )
