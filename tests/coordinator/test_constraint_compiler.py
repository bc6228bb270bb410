"""coordinator/constraint_compiler.py over the real grammar engine (the tiny tokenizer): a constraint compiles once
and is then served from the cache, a bad one is InvalidArgument naming the problem, one past the time limit is
refused while its compile runs on into the cache, and two requests for one constraint share one compile."""

from __future__ import annotations

import asyncio
import functools
import json
import threading

import pytest
import tiny_models
from waiting import wait_until

from coordinator.constraint_compiler import ConstraintCompiler
from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument
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
    compiler = ConstraintCompiler(lambda: held, timeout_s=0.05, threads=2, cache_size=4)
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
