"""Routing by prefix through the whole system (docs/design.md, "Routing by prefix").

Two target and two draft replicas, 8 concurrent 6-turn greedy conversations (each turn resends the
history; all start with one system prompt): with routing by prompt prefix at least 90% of the turns after
the first find the whole last turn in the target's cache (``cached_tokens`` all its whole blocks), also when the turns alternate between two coordinators that
share nothing but the endpoint list; routing by session id (``route_prefix_tokens=0``) is measured and
reported beside it. Every conversation is token-identical to stock transformers ``generate()``. What happens
when the replica a prefix lives on is killed: ``tests/reliability/test_kill_prefix_routing.py``.

Real Redis, real gRPC servers, the tiny float32 pair. Run with ``-s`` to see the hit rates.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from pydantic import SecretStr

from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONVERSATIONS = 8
TURNS = 6
MAX_NEW = 8
HOST = "127.0.0.1"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(pair, redis_server):
    """Two targets and two drafts (stock kernels, as the reference), started once."""
    from specserve.draft.server import start_draft
    from specserve.target.server import start_target

    common = {"redis_url": SecretStr(redis_server.url), "host": HOST, "port": 0, "device": "cpu"}
    common |= {"dtype": "float32", "warmup": False}
    targets = [
        await start_target(TargetSettings(**common, model=str(pair.target_dir), kernels="stock"))
        for _ in range(2)
    ]
    drafts = [await start_draft(DraftSettings(**common, model=str(pair.draft_dir))) for _ in range(2)]
    yield targets, drafts
    for app in [*targets, *drafts]:
        await app.stop(0)


@contextlib.asynccontextmanager
async def coordinator(pair, redis_url: str, targets, drafts, **overrides) -> AsyncIterator[str]:
    from specserve.coordinator.server import start_coordinator

    settings = CoordinatorSettings(
        redis_url=SecretStr(redis_url),
        host=HOST,
        port=0,
        target_endpoints=[f"{HOST}:{t.port}" for t in targets],
        draft_endpoints=[f"{HOST}:{d.port}" for d in drafts],
        tokenizer=str(pair.target_dir),
        keep_ended_sessions_s=600.0,
        session_rate_per_client=1e9,
        target_backoff_s=30.0,
        target_max_backoff_s=30.0,
        **overrides,
    )
    app = await start_coordinator(settings)
    try:
        yield f"{HOST}:{app.port}"
    finally:
        await app.stop(0.5)


BLOCK = 16  # the workers' default prefix_block_tokens
SYSTEM = 30  # tokens of a system prompt every conversation starts with


def _new_tokens(conversation: int, turn: int, vocab: int) -> list[int]:
    """Turn 0: the shared system prompt and a 40-token first message (the first 64 tokens, the routing
    key, are the conversation's own); later turns: 23 new tokens."""
    gen = torch.Generator().manual_seed(7919 * conversation + turn)
    new = torch.randint(1, vocab, (40 if turn == 0 else 23,), generator=gen).tolist()
    if turn == 0:
        system = torch.randint(1, vocab, (SYSTEM,), generator=torch.Generator().manual_seed(5)).tolist()
        return system + new
    return new


async def _turns(
    addresses: list[str], histories: dict[int, list[int]], turns: range, vocab: int
) -> list[int]:
    """Run ``turns`` of every conversation (all conversations of a turn at once; turn ``t`` through
    ``addresses[t % len]``); returns for each turn after the conversation's first its ``cached_tokens``
    minus what a cache holding the whole last turn gives (0: a full hit; negative: partial or a miss)."""
    cached: list[int] = []
    for turn in turns:
        prompts = {c: histories[c] + _new_tokens(c, turn, vocab) for c in histories}
        address = addresses[turn % len(addresses)]
        replies = await asyncio.gather(
            *(
                sf.generate(address, sf.request(prompts[c], max_new_tokens=MAX_NEW, gamma=3))
                for c in histories
            )
        )
        for c, reply in zip(histories, replies, strict=True):
            assert reply.stats is not None
            if turn > 0:
                whole = (len(histories[c]) - 1) // BLOCK * BLOCK  # the last turn's cached tokens
                cached.append(reply.stats.cached_tokens - whole)
            histories[c] = prompts[c] + reply.token_ids
    return cached


def _expected_all(pair, histories: dict[int, list[int]], turns: int, vocab: int) -> None:
    """Every conversation's history is what ``generate()`` gives turn by turn."""
    for c, history in histories.items():
        rebuilt: list[int] = []
        for turn in range(turns):
            prompt = rebuilt + _new_tokens(c, turn, vocab)
            rebuilt = prompt + sf.reference_greedy(pair.target_dir, prompt, MAX_NEW)
        assert history == rebuilt, c


def _hit_rate(cached: list[int]) -> float:
    """Turns whose target held the whole history of the conversation's last turn."""
    assert all(n <= 0 for n in cached)  # never more than the last turn left
    return sum(1 for n in cached if n == 0) / len(cached)


async def test_turns_find_their_prefix_on_the_target_tier(workers, pair, redis_server):
    targets, drafts = workers
    vocab = len(pair.tokenizer)
    url = redis_server.url
    async with (
        coordinator(pair, url, targets, drafts) as one,
        coordinator(pair, url, targets, drafts) as two,
        coordinator(pair, url, targets, drafts, route_prefix_tokens=0) as by_session,
    ):
        prefix = {c: [] for c in range(CONVERSATIONS)}
        prefix_rate = _hit_rate(await _turns([one], prefix, range(TURNS), vocab))
        shared = {c: [] for c in range(100, 100 + CONVERSATIONS)}
        shared_rate = _hit_rate(await _turns([one, two], shared, range(TURNS), vocab))
        session = {c: [] for c in range(200, 200 + CONVERSATIONS)}
        session_rate = _hit_rate(await _turns([by_session], session, range(TURNS), vocab))
    print(
        f"\ntarget-tier prefix hits, turns 2-{TURNS} of {CONVERSATIONS} conversations over 2 targets: "
        f"by prefix {prefix_rate:.0%}, by prefix through two coordinators {shared_rate:.0%}, "
        f"by session id {session_rate:.0%}"
    )
    assert prefix_rate >= 0.9 and shared_rate >= 0.9
    for histories in (prefix, shared, session):
        _expected_all(pair, histories, TURNS, vocab)
