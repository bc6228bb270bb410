"""The one thread a worker's model and session caches live on.

Both workers follow one rule (docs/design.md, "Conventions"): every model
call and every mutation of the session caches runs on the domain object's
:class:`ModelThread` (the draft's ``DraftEngine``, the target's ``Verifier``),
one call at a time, in submission order. The caches
(:class:`~specserve.engine.kvcache.SessionCacheStore`) are not thread-safe, and torch
releases the GIL inside its kernels, so the event loop keeps serving while the
model runs. Code that mutates caches calls :meth:`ModelThread.check` first, so
a call from the event loop fails loudly instead of racing the thread.

The caller's contextvars (the request id bound by the server interceptor) go
along with each call, so the thread's log lines carry them.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    """A single worker thread; :meth:`run` awaits a function run on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._local = threading.local()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread, after every call submitted before it; returns its result."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, ctx.run, self._inside, fn, *args
        )

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for it, from synchronous code (a worker's start-up:
        loading the model here too keeps every parallel torch region of the process on this one thread;
        oneDNN's packed kernels run slower on a thread other than the one that first ran parallel torch
        work, ``specserve/engine/cpu_kernels.py``; docs/benchmarks/history.md)."""
        ctx = contextvars.copy_context()
        return self._executor.submit(ctx.run, self._inside, fn, *args).result()

    def _inside(self, fn: Callable[..., T], *args: Any) -> T:
        self._local.active = True
        try:
            return fn(*args)
        finally:
            self._local.active = False

    def check(self) -> None:
        """Raise ``RuntimeError`` unless called from a function running on this thread."""
        if not getattr(self._local, "active", False):
            raise RuntimeError(f"model work must run on the {self.name} thread (ModelThread.run)")

    async def idle(self) -> None:
        """Return once every call submitted so far has finished."""
        await self.run(lambda: None)

    def close(self, *, wait: bool) -> None:
        """Stop the thread: ``wait`` for the call in flight, or cancel what has not started."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


def serial_torch_off_the_model_thread() -> None:
    """Make torch run serially on the calling thread (a worker process's event loop, once its model has
    loaded on its :class:`ModelThread`) and on threads that start using torch after this call.

    With libgomp (PyTorch's OpenMP on Linux) every thread that runs a parallel torch region gets a team
    of its own, and once a process holds more OpenMP threads than there are cores, libgomp stops letting
    any team's threads spin at their barriers: every parallel region of the model's passes then waits on
    a futex, for the life of the process (what that cost a decoding step: docs/benchmarks/history.md);
    the first Verify call whose dense draft distributions the event loop checked with torch (parallel
    over ``[gamma, vocab]``) did it. Work on the event loop is small
    (a request's checks and conversions); serial there, it never starts a second team. The model thread
    took its thread count when it first ran torch (loading the model), which this leaves alone.
    """
    import sys

    if "torch" not in sys.modules:  # a role that does no tensor work (the coordinator)
        return
    import torch

    torch.set_num_threads(1)

