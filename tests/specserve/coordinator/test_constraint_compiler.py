"""specserve/coordinator/constraint_compiler.py over the real grammar engine (the tiny tokenizer): a constraint compiles once
and is then served from the cache, a bad one is InvalidArgument naming the problem, one past the time limit is
refused while its compile runs on into the cache, and two requests for one constraint share one compile.

The queue (issue 54): one client's compiles are bounded (RESOURCE_EXHAUSTED before the compile starts) and run
one at a time, so a client flooding slow schemas leaves another client's schema a thread; all clients' waiting
compiles are bounded; the time limit counts the compile, not the wait for a thread; a compile whose callers
left before it started never runs; a refused compile still running counts against its client until it ends."""

from __future__ import annotations

import asyncio
import functools
import json
import threading

import pytest
import tiny_models
from waiting import wait_until

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument, ResourceExhausted
from specserve.coordinator.constraint_compiler import ConstraintCompiler
from specserve.runtime import metrics

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _engine(tokenizer):
    from specserve.engine.grammar import GrammarEngine

    return GrammarEngine(tokenizer, 384, [0])


def _compiler(tokenizer, timeout_s: float = 60.0) -> ConstraintCompiler:
    return ConstraintCompiler(functools.partial(_engine, tokenizer), timeout_s=timeout_s, threads=2, cache_size=4)


def _count(outcome: str) -> float:
    return metrics.CONSTRAINT_COMPILES.labels(outcome=outcome)._value.get()


def _slow_schema(n: int = 120) -> Constraint:
    """A schema that takes a while to compile: many properties, each with a pattern."""
    props = {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 7 + 3}}}[0-9]{{2,5}}(x|y|z){{1,3}}$"} for i in range(n)}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return Constraint("json_schema", json.dumps(schema))


async def test_a_constraint_compiles_once_then_comes_from_the_cache(tokenizer):
    compiler = _compiler(tokenizer)
    constraint = Constraint("regex", "[0-9]{3}-[0-9]{4}")
    compiled_before, cached_before = _count("compiled"), _count("cached")
    first = await compiler.compile(constraint)
    again = await compiler.compile(Constraint("regex", "[0-9]{3}-[0-9]{4}"))  # an equal constraint
    assert again is first and compiler.cached(constraint) is first
    assert (_count("compiled") - compiled_before, _count("cached") - cached_before) == (1, 1)
    # The cache keeps the most recently used: four more push the first out.
    for i in range(4):
        await compiler.compile(Constraint("choice", (f"c{i}",)))
    assert compiler.cached(constraint) is None
    compiler.close()


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (Constraint("regex", "a(b"), "does not compile"),
        (Constraint("json_schema", '{"type": "strin"}'), "strin"),
        (Constraint("grammar", 'root ::= "a" | b'), "'b' not found"),
        (Constraint("json_schema", '{"not": {"type": "string"}}'), "not"),
    ],
    ids=["regex", "schema type", "grammar rule", "unenforceable keyword"],
)
async def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_the_problem(tokenizer, constraint, words):
    compiler = _compiler(tokenizer)
    invalid_before = _count("invalid")
    with pytest.raises(InvalidArgument) as info:
        await compiler.compile(constraint)
    assert constraint.kind in info.value.message and words in info.value.message
    assert _count("invalid") - invalid_before == 1 and compiler.cached(constraint) is None
    compiler.close()


class _HeldEngine:
    """The real engine, whose compiles wait until the test lets them go (a slow compile that stays slow on a
    loaded machine: a timing-only slow schema finished before a descheduled event loop saw its time limit)."""

    def __init__(self, tokenizer) -> None:
        self.inner = _engine(tokenizer)
        self.release = threading.Event()

    def compile(self, constraint: Constraint):
        assert self.release.wait(120), "the test never released the compile"
        return self.inner.compile(constraint)


async def test_a_compile_past_the_limit_is_refused_and_finishes_into_the_cache(tokenizer):
    held = _HeldEngine(tokenizer)
    # A thread takes the job at once on a quiet machine; the wait is bounded apart (wait_s), so a loaded one
    # cannot turn the compile's own time limit into a refused wait.
    compiler = ConstraintCompiler(lambda: held, timeout_s=0.05, threads=2, cache_size=4, wait_s=60)
    constraint = _slow_schema()
    timeouts_before = _count("timeout")
    with pytest.raises(InvalidArgument) as info:
        await compiler.compile(constraint)
    assert "did not compile within 0.05 s" in info.value.message and "constraint_compile_timeout_s" in info.value.message
    assert _count("timeout") - timeouts_before == 1
    held.release.set()  # the compile goes on after its caller was refused, into the cache
    await wait_until(lambda: compiler.cached(constraint) is not None, timeout_s=120, what="the compile to finish")
    assert await compiler.compile(constraint) is compiler.cached(constraint)  # a retry: from the cache
    compiler.close()


async def test_requests_for_one_constraint_share_one_compile(tokenizer):
    compiler = _compiler(tokenizer)
    constraint = _slow_schema(40)
    compiled_before = _count("compiled")
    results = await asyncio.gather(*(compiler.compile(constraint) for _ in range(4)))
    assert all(r is results[0] for r in results)
    assert _count("compiled") - compiled_before == 1
    compiler.close()


class _GatedEngine:
    """The real engine, whose compiles of the constraints in ``held`` wait until the test opens ``gate`` (a slow
    compile that stays slow however loaded the machine); every compile started is recorded."""

    def __init__(self, tokenizer, held=()) -> None:
        self.inner = _engine(tokenizer)
        self.held = set(held)
        self.gate = threading.Event()
        self.started: list[Constraint] = []

    def compile(self, constraint: Constraint):
        self.started.append(constraint)
        if constraint in self.held:
            assert self.gate.wait(120), "the test never opened the gate"
        return self.inner.compile(constraint)


def _slow(i: int) -> Constraint:
    return Constraint("regex", f"slow{i}[a-z]{{1,4}}")


async def test_a_client_flooding_slow_schemas_is_bounded_and_another_clients_schema_is_served(tokenizer):
    """The attacker's compiles run one at a time and at most ``per_client`` wait or run; the rest are refused
    before they start. The victim's new schema takes the other thread and compiles while every one of the
    attacker's is still held."""
    slow = [_slow(i) for i in range(8)]
    engine = _GatedEngine(tokenizer, held=slow)
    compiler = ConstraintCompiler(lambda: engine, timeout_s=60, threads=2, cache_size=16, queue=64, per_client=4)
    refused_before = _count("refused")
    flood = [asyncio.ensure_future(compiler.compile(c, "attacker")) for c in slow]
    await wait_until(lambda: len(engine.started) == 1, timeout_s=30, what="the attacker's first compile to start")
    await asyncio.sleep(0)
    refused = [f for f in flood if f.done()]
    assert len(refused) == 4  # past the attacker's bound: refused at once, never started
    for f in refused:
        with pytest.raises(ResourceExhausted, match="constraint_compile_queue_per_client"):
            f.result()
    assert _count("refused") - refused_before == 4
    assert compiler.pending("attacker") == 4 and compiler.waiting == 3  # one running, three waiting their turn

    victim = Constraint("regex", "[0-9]{3}")
    compiled = await asyncio.wait_for(compiler.compile(victim, "victim"), 60)  # bounds a hang only
    assert compiled is compiler.cached(victim)
    assert engine.started[0] == slow[0] and victim in engine.started and len(engine.started) == 2  # the attacker's
    # second compile did not take the free thread: a client's compiles run one at a time

    engine.gate.set()
    accepted = [(c, f) for c, f in zip(slow, flood, strict=True) if f not in refused]
    results = await asyncio.gather(*(f for _, f in accepted))
    assert all(r is compiler.cached(c) for r, (c, _) in zip(results, accepted, strict=True))
    assert compiler.pending("attacker") == 0 and compiler.waiting == 0
    compiler.close()


async def test_the_queue_is_bounded_for_all_clients(tokenizer):
    slow = [_slow(10 + i) for i in range(4)]
    engine = _GatedEngine(tokenizer, held=slow)
    compiler = ConstraintCompiler(lambda: engine, timeout_s=60, threads=2, cache_size=16, queue=2, per_client=4)
    running = [asyncio.ensure_future(compiler.compile(c, f"client{i}")) for i, c in enumerate(slow[:2])]
    await wait_until(lambda: len(engine.started) == 2, timeout_s=30, what="two compiles to start")
    waiting = [asyncio.ensure_future(compiler.compile(c, f"client{i + 2}")) for i, c in enumerate(slow[2:])]
    await asyncio.sleep(0)
    assert compiler.waiting == 2
    with pytest.raises(ResourceExhausted, match="constraint_compile_queue\\)") as info:
        await compiler.compile(Constraint("regex", "[0-9]{4}"), "client9")
    assert "2 constraint compiles are waiting" in info.value.message and info.value.retry_after_s
    assert len(engine.started) == 2  # the refused one never started
    engine.gate.set()
    await asyncio.gather(*running, *waiting)
    compiler.close()


async def test_the_time_limit_counts_the_compile_not_the_wait_for_a_thread(tokenizer):
    """A compile that waited 0.6 of the limit for a thread, then compiled for 0.6 of it, is served (1.2 limits
    in all); one that compiles past the limit is refused, naming it."""
    limit = 3.0
    first, second = _slow(20), _slow(21)
    engine = _GatedEngine(tokenizer, held=[first, second])
    gate2 = threading.Event()
    inner_compile = engine.compile

    def compile_(constraint):  # ``second`` has a gate of its own
        if constraint == second:
            engine.started.append(constraint)
            assert gate2.wait(120)
            return engine.inner.compile(constraint)
        return inner_compile(constraint)

    engine.compile = compile_
    compiler = ConstraintCompiler(lambda: engine, timeout_s=limit, threads=2, cache_size=16, queue=8, per_client=4)
    a = asyncio.ensure_future(compiler.compile(first, "a"))  # holds one thread
    b = asyncio.ensure_future(compiler.compile(_slow(22), "a"))  # waits: "a" compiles one at a time
    await wait_until(lambda: len(engine.started) == 1, timeout_s=30, what="a's compile to start")
    c = asyncio.ensure_future(compiler.compile(second, "c"))  # the other thread
    await wait_until(lambda: second in engine.started, timeout_s=30, what="c's compile to start")
    await asyncio.sleep(0.6 * limit)
    engine.gate.set()  # "a"'s first ends; its second starts after 0.6 of the limit in the queue
    assert await a is compiler.cached(first)
    await asyncio.sleep(0.6 * limit)  # c has compiled 1.2 limits: refused; b waited 0.6, compiled briefly: served
    with pytest.raises(InvalidArgument, match="did not compile within 3 s"):
        await c
    assert await b is compiler.cached(_slow(22))
    gate2.set()
    await wait_until(lambda: compiler.pending("c") == 0, timeout_s=30, what="c's compile to end")
    compiler.close()


async def test_a_compile_refused_past_its_limit_counts_against_its_client_until_it_ends(tokenizer):
    slow = _slow(30)
    engine = _GatedEngine(tokenizer, held=[slow])
    compiler = ConstraintCompiler(lambda: engine, timeout_s=0.05, threads=2, cache_size=16, queue=8, per_client=1)
    with pytest.raises(InvalidArgument, match="did not compile within"):
        await compiler.compile(slow, "a")
    assert compiler.pending("a") == 1  # still running on its thread
    with pytest.raises(ResourceExhausted, match="already has 1 constraint compiles"):
        await compiler.compile(_slow(31), "a")
    assert await compiler.compile(Constraint("regex", "x{2}"), "b") is not None  # another client is not held up
    engine.gate.set()
    await wait_until(lambda: compiler.pending("a") == 0, timeout_s=30, what="the refused compile to end")
    assert compiler.cached(slow) is not None  # it ended in the cache: a retry is served from it
    compiler.close()


async def test_a_compile_whose_callers_left_before_it_started_never_runs(tokenizer):
    slow = _slow(40)
    engine = _GatedEngine(tokenizer, held=[slow])
    compiler = ConstraintCompiler(lambda: engine, timeout_s=60, threads=2, cache_size=16, queue=8, per_client=4)
    running = asyncio.ensure_future(compiler.compile(slow, "a"))
    await wait_until(lambda: len(engine.started) == 1, timeout_s=30, what="the first compile to start")
    gone = asyncio.ensure_future(compiler.compile(_slow(41), "a"))  # waits behind a's running compile
    await asyncio.sleep(0)
    assert compiler.waiting == 1
    gone.cancel()  # its client went away
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert compiler.waiting == 0 and compiler.pending("a") == 1
    engine.gate.set()
    await running
    await asyncio.sleep(0.1)
    assert engine.started == [slow]  # the abandoned compile never ran
    compiler.close()


def test_the_compiler_needs_two_threads_or_more():
    with pytest.raises(ValueError, match="threads >= 2"):
        ConstraintCompiler(lambda: None, timeout_s=1, threads=1, cache_size=1)
