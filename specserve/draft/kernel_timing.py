"""The draft's kernel path per kind of machine: its drafting step timed on both paths.

The drafting passes are row-invariant (:mod:`specserve.engine.row_invariant`): on the stock kernels every
linear layer runs on 16-row blocks, on packed oneDNN weights the rows go unpadded where the kernel allows.
Which costs less per drafted token depends on the CPU, so with ``kernels='auto'`` the draft runs the path
recorded for its kind of machine in the deployment's Redis, timing both first where none is recorded
(:func:`specserve.engine.kernel_choice.shared_choice`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from specserve.api.params import SamplingParams
from specserve.draft.proposers import DraftRequest, ModelProposer
from specserve.engine import cpu_kernels, kernel_choice
from specserve.engine.kvcache import SessionCacheStore
from specserve.engine.models import LoadedModel, vocab_size_of
from specserve.runtime.config import DraftSettings


def time_drafting(model: Any, *, gamma: int = 4, context: int = 64, repeats: int = 5) -> tuple[str, dict[str, float]]:
    """Milliseconds per drafted token of one session's proposals of ``gamma`` tokens on each path (median
    of ``repeats`` alternating rounds after one that warms both), and the faster path. The model is left
    to be prepared again by the proposer that serves."""
    caches = SessionCacheStore(model, max_sessions=2, budget_bytes=1 << 30, ttl_s=3600.0, prefix_cache=False)
    proposer = ModelProposer(caches, kernels="onednn")
    packed = model._specserve_packed_weights
    vocab = vocab_size_of(model)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit:  # a short context: the rounds' catch-up tokens and the proposal must fit in it
        context = max(1, min(context, int(limit) - gamma - 2 * (repeats + 1) - 1))
    committed = {p: [(7919 * i + 13) % vocab for i in range(context)] for p in kernel_choice.PATHS}
    samples: dict[str, list[float]] = {p: [] for p in kernel_choice.PATHS}
    for rep in range(repeats + 1):
        for path in kernel_choice.PATHS if rep % 2 else kernel_choice.PATHS[::-1]:
            model._specserve_packed_weights = packed if path == "onednn" else None
            request = DraftRequest(
                session_id=f"kernels-{path}",
                committed=tuple(committed[path]),
                gamma=gamma,
                sampling=SamplingParams(temperature=0.0),
                seed=0,
            )
            start = time.perf_counter_ns()
            drafted = proposer.propose(request)
            elapsed_ms = (time.perf_counter_ns() - start) / 1e6 / gamma
            committed[path] += [drafted.token_ids[0], 5 % vocab]  # one accepted and a bonus token: the next catch-up
            if rep:
                samples[path].append(elapsed_ms)
    model._specserve_packed_weights = None
    timings = {p: statistics.median(v) for p, v in samples.items()}
    return min(timings, key=timings.__getitem__), timings


def drafting_kernels(settings: DraftSettings, model: LoadedModel) -> cpu_kernels.Kernels:
    """The kernel path the draft's passes run: ``settings.kernels`` where it names one; for 'auto' where both
    paths apply, the one recorded for this kind of machine in the deployment's Redis."""
    if settings.kernels != "auto" or cpu_kernels.resolve("auto", model.device, model.dtype) != "onednn":
        return settings.kernels
    kind = kernel_choice.hardware_kind(model.model, "draft")
    choice = kernel_choice.shared_choice(
        settings.redis_url.get_secret_value(), kind, lambda: time_drafting(model.model)
    )
    return "onednn" if choice.kernels == "onednn" else "stock"
