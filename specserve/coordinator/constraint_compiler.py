"""A request's constraint compiled before its session opens: in a bounded, fair queue, off the event loop,
with a time limit, into the process's one cache of compiled grammars.

A constraint that does not compile is then INVALID_ARGUMENT naming the problem before any session, Redis
record or worker call exists. A compile is a job charged to the client that asked first; each client has at
most ``per_client`` jobs waiting or running and runs one at a time on ``threads`` >= 2 low-priority threads,
so one client's slow schemas hold one thread; a compile past ``timeout_s`` is the constraint's fault
(INVALID_ARGUMENT), a wait past it the server's (RESOURCE_EXHAUSTED), and a refused compile runs on into the
cache, still counted against its client. The ``cache_size`` most recent grammars are kept here and served on
the event loop; a request holds its grammar into its session, so nothing compiles later. Why: docs/design.md,
"Constrained decoding"; the limits and metrics: docs/operations.md, "Limits".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument, ResourceExhausted
from specserve.runtime import metrics

#: The retry hint of a request refused because the queue is full or a thread was not free in time.
BUSY_RETRY_AFTER_S = 1.0


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class Compiles(Protocol):
    """What compiles a constraint (``specserve.engine.grammar.GrammarEngine``): thread-safe, raising
    InvalidArgument for a constraint that does not compile."""

    def compile(self, constraint: Constraint) -> Any: ...


@dataclass(eq=False)
class _Job:
    """One constraint's compile: charged to ``client``; ``started`` resolves (to the monotonic start) when
    a thread takes it, ``done`` to the compiled grammar or the compile's error."""

    constraint: Constraint
    client: Hashable
    started: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiters: int = 0


class ConstraintCompiler:
    """Compiles constraints for one coordinator (see the module docstring). ``engine``: builds the engine, on
    a compiling thread at the first constraint (reading the tokenizer's table takes a while; a coordinator
    without constraints never builds it)."""

    def __init__(
        self,
        engine: Callable[[], Compiles],
        *,
        timeout_s: float,
        threads: int,
        cache_size: int,
        queue: int = 64,
        per_client: int = 8,
        wait_s: float | None = None,
    ) -> None:
        if timeout_s <= 0 or threads < 2 or cache_size < 1 or queue < 1 or per_client < 1:
            raise ValueError(
                "the constraint compiler needs timeout_s > 0, threads >= 2 (one client's compiles hold one "
                "thread at a time; the others are for other clients), cache_size >= 1, queue >= 1 and "
                "per_client >= 1"
            )
        self._make_engine = engine
        self._engine: Compiles | None = None
        self.timeout_s = timeout_s
        #: How long a job may wait for a compiling thread (None: ``timeout_s``).
        self.wait_s = timeout_s if wait_s is None else wait_s
        self.threads = threads
        self.queue = queue
        self.per_client = per_client
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        #: Every job not finished, by constraint (waiting or running): a second request waits on it.
        self._jobs: dict[Constraint, _Job] = {}
        self._waiting: collections.deque[_Job] = collections.deque()  # oldest first
        self._running: collections.Counter[Hashable] = collections.Counter()  # jobs running, by client
        self._pending: collections.Counter[Hashable] = collections.Counter()  # waiting or running, by client
        # All of the above: written by the compiling threads and on the loop. The condition wakes a thread.
        self._lock = threading.Condition()
        self._engine_lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._closed = False

    # ------------------------------------------------------------------ the event loop's side

    def cached(self, constraint: Constraint) -> Any | None:
        """The compiled grammar of ``constraint`` when the cache holds it (it is then the most recent)."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
            return compiled

    async def compile(self, constraint: Constraint, client: Hashable = None) -> Any:
        """The compiled grammar of ``constraint``, for ``client`` (an identity; None: the unidentified
        callers, one client together). InvalidArgument when it does not compile, or not within ``timeout_s``;
        ResourceExhausted when the queue's bounds refuse it or no thread took it within ``timeout_s``."""
        compiled = self.cached(constraint)
        if compiled is not None:
            metrics.CONSTRAINT_COMPILES.labels(outcome="cached").inc()
            return compiled
        job = self._join(constraint, client)
        try:
            return await self._wait(job)
        finally:
            self._leave(job)

    def _join(self, constraint: Constraint, client: Hashable) -> _Job:
        """The job compiling ``constraint`` (a new one, charged to ``client``, when none is), with one more
        waiter; ResourceExhausted when a new job does not fit the bounds."""
        with self._lock:
            if self._closed:
                raise ResourceExhausted("this coordinator is shutting down; send the request to another replica")
            job = self._jobs.get(constraint)
            if job is None:
                if self._pending[client] >= self.per_client:
                    metrics.CONSTRAINT_COMPILES.labels(outcome="refused").inc()
                    raise ResourceExhausted(
                        f"this client already has {self._pending[client]} constraint compiles waiting or running "
                        f"(at most {self.per_client}: constraint_compile_queue_per_client; a compile past its time "
                        "limit counts until it ends); retry when they have finished",
                        retry_after_s=self.timeout_s,
                    )
                if len(self._waiting) >= self.queue:
                    metrics.CONSTRAINT_COMPILES.labels(outcome="refused").inc()
                    raise ResourceExhausted(
                        f"{len(self._waiting)} constraint compiles are waiting for a thread (at most {self.queue}: "
                        "constraint_compile_queue); retry shortly",
                        retry_after_s=BUSY_RETRY_AFTER_S,
                    )
                job = _Job(constraint, client)
                self._jobs[constraint] = job
                self._pending[client] += 1
                self._waiting.append(job)
                self._start_workers()
                self._lock.notify()
                self._set_gauges()
            job.waiters += 1
            return job

    async def _wait(self, job: _Job) -> Any:
        started = asyncio.wrap_future(job.started)
        done = asyncio.wrap_future(job.done)
        for waiter in (started, done):  # an outcome nobody awaits any more is not an error here
            waiter.add_done_callback(_retrieve)
        try:
            # shield: a caller's limit (or cancellation) leaves the job to its other callers and to the cache.
            began = await asyncio.wait_for(asyncio.shield(started), self.wait_s)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11
            metrics.CONSTRAINT_COMPILES.labels(outcome="refused").inc()
            with self._lock:
                own = self._running[job.client] > 0
            why = (
                "this client's earlier constraint compile is still running (a client's compiles run one at a time)"
                if own
                else f"all {self.threads} compiling threads were busy with other clients' compiles"
            )
            raise ResourceExhausted(
                f"the constraint waited {self.wait_s:g} s for a compiling thread: {why}; retry shortly",
                retry_after_s=BUSY_RETRY_AFTER_S,
            ) from None
        left = began + self.timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(done), max(left, 0.0))
        except asyncio.TimeoutError:
            metrics.CONSTRAINT_COMPILES.labels(outcome="timeout").inc()
            raise InvalidArgument(
                f"the {job.constraint.kind} constraint did not compile within {self.timeout_s:g} s "
                "(constraint_compile_timeout_s); simplify it"
            ) from None

    def _leave(self, job: _Job) -> None:
        """One caller of ``job`` is done with it; a job nobody waits for and no thread took is dropped."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and not job.started.done() and job in self._waiting:
                self._waiting.remove(job)
                self._finish(job)
                job.started.cancel()
                job.done.cancel()
                self._set_gauges()

    # ------------------------------------------------------------------ the compiling threads

    def _start_workers(self) -> None:
        """Start the compiling threads at the first job (under the lock)."""
        if self._workers:
            return
        for i in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"constraint-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _next(self) -> _Job | None:
        """The oldest waiting job of a client that runs none (None: none may start; under the lock)."""
        for job in self._waiting:
            if self._running[job.client] == 0:
                return job
        return None

    def _work(self) -> None:
        from specserve.engine.grammar import lowest_thread_priority

        lowest_thread_priority()
        while True:
            with self._lock:
                job = self._next()
                while job is None and not self._closed:
                    self._lock.wait()
                    job = self._next()
                if job is None:
                    return
                self._waiting.remove(job)
                self._running[job.client] += 1
                self._set_gauges()
            job.started.set_result(time.monotonic())
            compiled: Any = None
            error: BaseException | None = None
            try:
                compiled = self._timed_compile(job.constraint)
            except BaseException as exc:  # the compile's error, to every caller still waiting
                error = exc
            with self._lock:  # the bounds first: a caller resumed by the outcome sees its compile ended
                self._running[job.client] -= 1
                self._finish(job)
                self._set_gauges()
                self._lock.notify_all()  # the client's next job may start now
            if error is not None:
                job.done.set_exception(error)
            else:
                job.done.set_result(compiled)

    def _finish(self, job: _Job) -> None:
        """Forget ``job`` (under the lock): its client's bound and the constraint's entry."""
        self._pending[job.client] -= 1
        for counter in (self._pending, self._running):
            if counter[job.client] <= 0:
                del counter[job.client]
        if self._jobs.get(job.constraint) is job:
            del self._jobs[job.constraint]

    def _set_gauges(self) -> None:
        metrics.CONSTRAINT_COMPILE_JOBS.labels(state="waiting").set(len(self._waiting))
        metrics.CONSTRAINT_COMPILE_JOBS.labels(state="running").set(sum(self._running.values()))

    def engine(self) -> Compiles:
        """The engine, built on first use (on a compiling thread)."""
        with self._engine_lock:  # not the queue's lock: the event loop never waits for the engine's build
            if self._engine is None:
                self._engine = self._make_engine()
            return self._engine

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

    # ------------------------------------------------------------------ introspection and shutdown

    def pending(self, client: Hashable = None) -> int:
        """Jobs charged to ``client``, waiting or running (a refused compile counts until it ends)."""
        with self._lock:
            return self._pending[client]

    @property
    def waiting(self) -> int:
        """Jobs waiting for a thread, all clients."""
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        """Stop taking compiles; waiting jobs are refused, those running finish on their threads."""
        with self._lock:
            self._closed = True
            for job in list(self._waiting):
                self._waiting.remove(job)
                self._finish(job)
                job.started.set_exception(ResourceExhausted("this coordinator is shutting down"))
                job.done.cancel()
            self._set_gauges()
            self._lock.notify_all()
