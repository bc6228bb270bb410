"""Model-level costs on this machine: one decode step of each model, and one
target pass over k positions (what verifying k - 1 draft tokens costs), all
with a warm KV cache, batch 1, float32. Medians of ``repeats`` timings.

The draft step is timed twice. Back to back (``draft_step_ms``, the cost
model's figure since the first run): the draft's weights stay in the CPU's
caches from one step to the next. And right after a target pass
(``draft_step_after_target_ms``), on the thread count the draft gets in a stack
of processes on one machine: that is how speculative decoding runs it, since
every round's verify pass streams the target's weights (540 MB for the default
target in float32) through the caches between two proposals, Hugging Face
assisted generation as much as the draft service.

The speculation bound these costs predict is the coordinator's own cost model
(:func:`specserve.coordinator.speculation.cost_model.predicted_speedup`), not a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specserve.bench.pair import forward, prefilled
from specserve.bench.timing import Laps
from specserve.coordinator.speculation.cost_model import predicted_speedup as cost_model_speedup


@dataclass
class Costs:
    target_step_ms: float
    draft_step_ms: float
    #: verify_ms[k - 1]: one target pass over k positions (k = gamma + 1)
    verify_ms: list[float]
    #: The draft step timed right after a target pass, on ``draft_threads`` threads (None: not measured,
    #: runs before 2026-12-02).
    draft_step_after_target_ms: float | None = None
    draft_threads: int | None = None

    @property
    def draft_to_target(self) -> float:
        return self.draft_step_ms / self.target_step_ms


def random_context(model, length: int):
    return prefilled(model, torch.randint(0, model.config.vocab_size, (length,)).tolist())


def time_pass(model, cache, k: int, repeats: int, *, warmup: int = 3) -> float:
    """ms of one pass over ``k`` new positions after ``cache`` (left as it was): the median of ``repeats``
    timings after ``warmup`` untimed ones."""
    laps = Laps(warmup)
    ids = torch.randint(0, model.config.vocab_size, (k,)).tolist()
    with torch.inference_mode():
        for _ in laps.rounds(repeats):
            with laps.time("pass"):
                forward(model, ids, cache)
            cache.crop(-k)
    return laps.median_ms("pass")


def time_draft_after_target(target, t_cache, draft, d_cache, repeats: int, draft_threads: int) -> float:
    """ms of one draft step (``draft_threads`` torch threads) timed right after a target step (this
    process's thread count), median of ``repeats``: the draft's step with the target's weights last
    through the caches, as in a speculative round."""
    threads = torch.get_num_threads()
    t_ids = torch.randint(0, target.config.vocab_size, (1,)).tolist()
    d_ids = torch.randint(0, draft.config.vocab_size, (1,)).tolist()
    laps = Laps(warmup=3)
    with torch.inference_mode():
        try:
            for _ in laps.rounds(repeats):
                forward(target, t_ids, t_cache)
                t_cache.crop(-1)
                torch.set_num_threads(draft_threads)
                with laps.time("draft"):
                    forward(draft, d_ids, d_cache)
                d_cache.crop(-1)
                torch.set_num_threads(threads)
        finally:
            torch.set_num_threads(threads)
    return laps.median_ms("draft")


def measure_costs(
    target, draft, *, context: int = 128, max_k: int = 9, repeats: int = 50, draft_threads: int | None = None
) -> Costs:
    """The pair's costs; ``draft_threads``: the draft's thread count in the stack (default: this process's)."""
    draft_threads = draft_threads or torch.get_num_threads()
    t_cache = random_context(target, context)
    d_cache = random_context(draft, context)
    verify = [time_pass(target, t_cache, k, repeats) for k in range(1, max_k + 1)]
    return Costs(
        target_step_ms=verify[0],
        draft_step_ms=time_pass(draft, d_cache, 1, repeats),
        verify_ms=verify,
        draft_step_after_target_ms=time_draft_after_target(
            target, t_cache, draft, d_cache, repeats, draft_threads
        ),
        draft_threads=draft_threads,
    )


def as_run(costs: Costs) -> Costs | None:
    """``costs`` with the draft step as speculative decoding pays it (after a target pass, on the stack's
    draft threads) in place of the back-to-back one; None when that was not measured."""
    if costs.draft_step_after_target_ms is None:
        return None
    return replace(costs, draft_step_ms=costs.draft_step_after_target_ms)


def predicted_speedup(alpha: float, gamma: int, costs: Costs) -> float:
    """The cost model's bound with these measured costs (``T_verify(k) = verify_ms[k - 1]``)."""
    return cost_model_speedup(
        alpha, gamma, costs.draft_step_ms, lambda k: costs.verify_ms[k - 1], costs.target_step_ms
    )
