"""A constraint that is slow to compile delays only its own session (issue 41, isolation), through the whole
system: real Redis, real gRPC target / draft / coordinator servers, the tiny float32 pair.

Ordinary greedy streams run while one constrained request arrives whose constraint takes seconds to compile:
here every compile of it by any engine is held for :data:`HOLD_S` (a test hook on ``GrammarEngine.compile``
that sleeps before compiling; sleeping releases the GIL, as llguidance does while it compiles). The
coordinator, the draft and the target each compile it once. The test records, per compile, the thread it ran
on and when, and when each ordinary chunk arrived, and asserts on those events, not on a speed:

* no worker compiles it on its model thread (the target's ``target-model``, the draft's ``draft-model``);
* while a worker compiles it, every ordinary stream keeps receiving chunks (their rounds go through the same
  target and draft: a compile inside a batch pass, or a call that batched their items with the new session's,
  would hold every one of them for the whole compile);
* the constrained output is target-alone constrained decoding (the same grammar, compiled off the thread).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import system_fixtures as sf

from specserve.api.constraints import Constraint
from specserve.engine.grammar import GrammarEngine
from specserve.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

EOS = 0
#: How long every compile of :data:`SLOW` is held (well inside the coordinator's 10 s compile limit).
HOLD_S = 2.0
#: The part of a compile's window not counted: the streams' calls already in flight when it began.
MARGIN_S = 0.5
#: A constraint no other test uses, so no engine of the module's stack has it cached.
SLOW = Constraint("regex", r"(alpha|beta|gamma)( [a-z]{1,5}){1,3}")
STREAMS = 3


async def _ordinary(address: str, prompt: list[int], arrivals: list[float], done: asyncio.Event) -> int:
    """Greedy requests one after the other until ``done``; each chunk's arrival time goes to ``arrivals``."""
    requests = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while not done.is_set():
            req = sf.request(prompt, max_new_tokens=120, ignore_eos=True, gamma=3)
            async for reply in stub.Generate(req, timeout=120):
                if reply.WhichOneof("event") == "chunk" and reply.chunk.token_ids:
                    arrivals.append(time.monotonic())
            requests += 1
    return requests


async def test_a_slow_compile_delays_only_its_own_session(stack, pair, monkeypatch):
    compiles: list[tuple[str, float, float]] = []  # (thread name, start, end) of each compile of SLOW
    real = GrammarEngine.compile
    held: set[int] = set()  # the engines whose first compile of SLOW was held (a later one is a cache hit)

    def held_compile(self: GrammarEngine, constraint: Constraint):
        if constraint != SLOW or id(self) in held:
            return real(self, constraint)
        held.add(id(self))
        start = time.monotonic()
        time.sleep(HOLD_S)
        compiled = real(self, constraint)
        compiles.append((threading.current_thread().name, start, time.monotonic()))
        return compiled

    monkeypatch.setattr(GrammarEngine, "compile", held_compile)
    prompts = [[5 + i, 17, 9 + 2 * i] for i in range(STREAMS)]
    arrivals: list[list[float]] = [[] for _ in prompts]
    done = asyncio.Event()
    streams = [
        asyncio.ensure_future(_ordinary(stack.address, p, a, done))
        for p, a in zip(prompts, arrivals, strict=True)
    ]
    try:
        while not all(len(a) >= 3 for a in arrivals):  # every stream flowing before the slow request
            await asyncio.sleep(0.05)
        slow_prompt = pair.tokenizer.encode("the quick brown", add_special_tokens=False)
        req = sf.request(slow_prompt, max_new_tokens=24, gamma=3)
        req.sampling.constraint.CopyFrom(SLOW.to_pb())
        slow = await asyncio.wait_for(sf.generate(stack.address, req, timeout_s=120), timeout=120)
    finally:
        done.set()
        await asyncio.gather(*streams, return_exceptions=True)

    workers = [(name, start, end) for name, start, end in compiles if not name.startswith("constraint")]
    assert len(compiles) - len(workers) == 1, compiles  # the coordinator's, on its compiling thread
    assert len(workers) == 2, compiles  # the draft's (its first Propose) and the target's (its first Verify)
    on_model_threads = [name for name, _, _ in workers if "model" in name]
    assert not on_model_threads, f"compiled on a model thread: {compiles}"
    for name, start, end in workers:
        during = [sum(start + MARGIN_S <= t <= end for t in a) for a in arrivals]
        assert all(n >= 2 for n in during), (
            f"ordinary streams' chunks while {name} compiled ({end - start:.1f} s): {during}"
        )
    monkeypatch.undo()  # the reference compiles the same constraint, unheld
    assert slow.token_ids == sf.reference_constrained(pair, slow_prompt, SLOW, 24, eos_token_id=EOS)


async def test_a_constraint_fresh_in_the_compilers_cache_is_not_compiled_on_the_event_loop(stack, pair, monkeypatch):
    """The coordinator keeps one cache of compiled grammars. A constraint kept fresh there while 256 others pass
    through is served without a compile on the event loop: before, the forced-text proposer asked the engine,
    whose own cache had aged it out in another order, and compiled it again on the loop, stalling every stream."""
    from specserve.engine.grammar import DEFAULT_CACHE_SIZE

    on_loop: list[Constraint] = []
    real = GrammarEngine.compile

    def recording(self: GrammarEngine, constraint: Constraint):
        try:
            asyncio.get_running_loop()
            on_loop.append(constraint)
        except RuntimeError:  # a compiling thread: no event loop runs there
            pass
        return real(self, constraint)

    monkeypatch.setattr(GrammarEngine, "compile", recording)
    compiler = stack.coordinator.coordinator.constraints
    kept = Constraint("regex", r"(yes|no)( sir)?")
    prompt = pair.tokenizer.encode("the quick brown", add_special_tokens=False)
    req = sf.request(prompt, max_new_tokens=8, gamma=2)
    req.sampling.constraint.CopyFrom(kept.to_pb())
    first = await sf.generate(stack.address, req)
    others = [Constraint("choice", (f"other{i}",)) for i in range(DEFAULT_CACHE_SIZE)]
    for i, other in enumerate(others):
        await compiler.compile(other)
        if i == len(others) // 2:
            await compiler.compile(kept)  # a hit: fresh in the compiler's cache, not in an engine's
    again = await sf.generate(stack.address, req)
    assert again.token_ids == first.token_ids
    assert on_loop == [], f"compiled on the event loop: {on_loop}"
