"""A request's constraint compiled before its session opens: off the event loop, with a time limit and a cache.

The coordinator compiles every constraint (:class:`~specserve.api.constraints.Constraint`) against
the target's tokenizer before the session opens. A schema, regex or grammar that does not compile is
then INVALID_ARGUMENT (HTTP 400) naming the problem, and no session, Redis record or worker call
exists yet. The size limit held earlier, when the constraint was built (``MAX_CONSTRAINT_BYTES``),
before any parsing.

* **Off the event loop.** Compiles run on ``threads`` threads of their own. The engine releases
  the GIL while it compiles, so the sessions the event loop drives keep their pace beside a slow
  schema.
* **A time limit.** A compile that takes longer than ``timeout_s`` is refused (INVALID_ARGUMENT,
  naming the limit). A compiling thread cannot be interrupted, so it finishes in the background and
  leaves the grammar in the engine's cache. A retry of the same constraint is then served from the
  cache, and while it still runs a retry waits on that same compile (with a time limit of its own)
  instead of starting another.
* **A cache.** The ``cache_size`` most recently used grammars are kept here, keyed by the constraint,
  and served on the event loop: a repeated schema costs a dictionary look-up and never waits behind
  a slow compile for a thread.

Metrics: ``specserve_coordinator_constraint_compiles_total{outcome}`` and
``specserve_coordinator_constraint_compile_seconds`` (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument
from specserve.runtime import metrics


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class Compiles(Protocol):
    """What compiles a constraint (``specserve.engine.grammar.GrammarEngine``): thread-safe, raising
    InvalidArgument for a constraint that does not compile."""

    def compile(self, constraint: Constraint) -> Any: ...


class ConstraintCompiler:
    """Compiles constraints for one coordinator on ``threads`` threads, each within ``timeout_s``, the
    ``cache_size`` most recently used kept. ``engine``: builds the engine, on a compiling thread at the
    first constraint (reading the tokenizer's table takes a while; a coordinator without constraints
    never builds it)."""

    def __init__(
        self, engine: Callable[[], Compiles], *, timeout_s: float, threads: int, cache_size: int
    ) -> None:
        if timeout_s <= 0 or threads < 1 or cache_size < 1:
            raise ValueError("the constraint compiler needs timeout_s > 0, threads >= 1 and cache_size >= 1")
        self._make_engine = engine
        self._engine: Compiles | None = None
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="constraint"
        )
        #: Compiles in progress, by constraint: a second request for one waits on the first's.
        self._running: dict[Constraint, concurrent.futures.Future] = {}
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        # The cache and the running compiles: written by the compiling threads, read on the loop. Reentrant:
        # a compile done before its callback is added runs the callback at once, on the thread holding it.
        self._lock = threading.RLock()
        self._engine_lock = threading.Lock()

    def cached(self, constraint: Constraint) -> Any | None:
        """The compiled grammar of ``constraint`` when the cache holds it (it is then the most recent)."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
            return compiled

    async def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint``; InvalidArgument when it does not compile, or not within
        ``timeout_s``."""
        compiled = self.cached(constraint)
        if compiled is not None:
            metrics.CONSTRAINT_COMPILES.labels(outcome="cached").inc()
            return compiled
        with self._lock:
            future = self._running.get(constraint)
            if future is None:
                future = self._pool.submit(self._timed_compile, constraint)
                self._running[constraint] = future
                future.add_done_callback(lambda _f: self._forget(constraint))
        waiter = asyncio.wrap_future(future)
        waiter.add_done_callback(_retrieve)  # a compile that fails after its caller gave up is not an error here
        try:
            # shield: a caller's time limit (or cancellation) leaves the compile running for the cache.
            return await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11
            metrics.CONSTRAINT_COMPILES.labels(outcome="timeout").inc()
            raise InvalidArgument(
                f"the {constraint.kind} constraint did not compile within {self.timeout_s:g} s "
                "(constraint_compile_timeout_s); simplify it"
            ) from None

    def engine(self) -> Compiles:
        """The engine, built on first use (on a compiling thread)."""
        with self._engine_lock:  # not the cache's lock: the event loop never waits for the engine's build
            if self._engine is None:
                self._engine = self._make_engine()
            return self._engine

    def _forget(self, constraint: Constraint) -> None:
        with self._lock:
            self._running.pop(constraint, None)

    def _timed_compile(self, constraint: Constraint) -> Any:
        started = time.perf_counter()
        try:
            compiled = self.engine().compile(constraint)
        except InvalidArgument:
            metrics.CONSTRAINT_COMPILES.labels(outcome="invalid").inc()
            raise
        metrics.CONSTRAINT_COMPILE_SECONDS.observe(time.perf_counter() - started)
        metrics.CONSTRAINT_COMPILES.labels(outcome="compiled").inc()
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        """Stop taking compiles; those running finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
