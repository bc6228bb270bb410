"""The target's verify-cost curve, measured once at start-up.

A verify pass over ``k`` positions does not cost ``k`` times a decode step, nor
the same: on an accelerator with spare parallelism it costs about a step,
on a CPU a pass over two positions or more runs matrix-matrix kernels and
costs well over a step (docs/benchmarks/README.md, "Model costs"). Whether speculation pays at all turns on that shape, and
a coordinator whose only data is a session at one gamma cannot learn it (every
round feeds the same number of positions). So the target measures it: one
session's pass over a short context, feeding ``k = 1 .. max_gamma + 1``
positions (at most :data:`CURVE_MAX_POSITIONS`), the median of a few repeats with the ``k`` interleaved (a busy
machine slows all alike), each pass rolled back. ``GetTargetInfo`` reports it
and the coordinator's cost model takes its *ratios* as prior rows
(``specserve/coordinator/speculation/cost_model.py``; docs/design.md, "Cost and policy").

It runs on the verifier's model thread before the server takes calls; with
the default target on 2 CPU cores it takes about 5 s (36 passes), and a machine
busy with something else at that moment skews it (the coordinator's online fit
then corrects the scale from real rounds, the shape only where it sees them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from specserve.engine.models import LoadedModel, pass_timer

__all__ = ["CURVE_MAX_POSITIONS", "measure_verify_curve"]

#: Context the measured passes attend over (a short chat turn).
CONTEXT_TOKENS = 64
#: Most positions measured at start-up: the adaptive policy's ladder tops at gamma 8 (the cost model
#: extrapolates its line beyond).
CURVE_MAX_POSITIONS = 9


def measure_verify_curve(
    model: LoadedModel,
    max_positions: int,
    *,
    repeats: int = 3,
    context_tokens: int = CONTEXT_TOKENS,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> tuple[int, ...]:
    """Server time (ns) of one session's verify pass feeding ``k = 1 .. max_positions`` positions.

    Index ``k - 1`` of the result is the median of ``repeats`` passes over ``context_tokens`` cached
    tokens (fewer when the model's context is shorter). Must run where the model runs (the model thread).
    """
    if max_positions < 1 or repeats < 1:
        raise ValueError("max_positions and repeats must be >= 1")
    time_pass = pass_timer(model.model, model.device, context=context_tokens, most=max_positions, clock=clock)
    samples: list[list[int]] = [[] for _ in range(max_positions)]
    for rep in range(repeats + 1):  # the first sweep warms every shape up and is not kept
        for k in range(1, max_positions + 1):
            elapsed = time_pass(k)
            if rep:
                samples[k - 1].append(elapsed)
    return tuple(max(1, int(statistics.median(s))) for s in samples)
