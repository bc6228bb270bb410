"""The prefix cache with the feature head, through the whole system (issue 53; docs/design.md, "The prefix
cache" and "The feature head").

Greedy multi-turn chats of default requests (the head drafts: ``default_proposer='auto'``), each turn's
prompt the last turn's prompt, its completion and new tokens, three conversations at a time, on two target
and two draft replicas (routing by prefix) with the prefix cache on, and on a stack with it off. Every turn:

* is token-identical on both and to stock transformers ``generate()``;
* reports ``cached_tokens`` covering the earlier turns' whole blocks;
* is not prefilled again by the target (``specserve_target_positions_processed_total``);
* ships the draft only the features of its new positions, not the history's
  (``specserve_coordinator_feature_bytes_total``), while the draft tier's head attaches its context of the
  history (``specserve_prefix_cache_hits_total{role="head"}``).

Real Redis, real gRPC servers, the tiny float32 pair and a tiny trained head.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from prometheus_client import REGISTRY
from pydantic import SecretStr

from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

BLOCK = 16  # the workers' default prefix_block_tokens
CONVERSATIONS = 3
TURNS = 5
MAX_NEW = 10
GAMMA = 3
HOST = "127.0.0.1"
HEAD_PROMPTS = [[5, 17, 33, 2, 91, 14], [40, 41, 42, 43], [7] * 9, [100, 3, 250, 8, 19, 27, 64, 5]]


@pytest.fixture(scope="module")
def head_dir(pair, tmp_path_factory):
    return sf.tiny_head(pair, tmp_path_factory, HEAD_PROMPTS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cached(pair, head_dir, redis_server) -> AsyncIterator[str]:
    """Two targets and two drafts serving the head, the prefix cache on (the default); a coordinator."""
    from specserve.coordinator.server import start_coordinator
    from specserve.draft.server import start_draft
    from specserve.target.server import start_target

    common = {"redis_url": SecretStr(redis_server.url), "host": HOST, "port": 0, "device": "cpu"}
    common |= {"dtype": "float32", "warmup": False}
    targets = [
        await start_target(TargetSettings(**common, model=str(pair.target_dir), kernels="stock")) for _ in range(2)
    ]
    head = sf.head_overrides(pair, head_dir)
    drafts = [await start_draft(DraftSettings(**common, model=str(pair.draft_dir), **head)) for _ in range(2)]
    app = await start_coordinator(
        CoordinatorSettings(
            redis_url=SecretStr(redis_server.url),
            host=HOST,
            port=0,
            target_endpoints=[f"{HOST}:{t.port}" for t in targets],
            draft_endpoints=[f"{HOST}:{d.port}" for d in drafts],
            tokenizer=str(pair.target_dir),
            keep_ended_sessions_s=600.0,
            session_rate_per_client=1e9,
            default_proposer="auto",
        )
    )
    try:
        yield f"{HOST}:{app.port}"
    finally:
        await app.stop(0.5)
        for worker in [*targets, *drafts]:
            await worker.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def uncached(pair, head_dir, redis_server) -> AsyncIterator[str]:
    """One target and one draft serving the head, the prefix cache off."""
    async with sf.local_stack(
        pair,
        redis_server.url,
        worker_overrides={"prefix_cache": False},
        draft_overrides=sf.head_overrides(pair, head_dir),
        coordinator_overrides={"default_proposer": "auto"},
    ) as stack:
        yield stack.address


def _new_tokens(conversation: int, turn: int, vocab: int) -> list[int]:
    """Turn 0: 70 tokens (past the 64 that key the routing); later turns: 23 new ones."""
    gen = torch.Generator().manual_seed(3001 * conversation + turn)
    return torch.randint(1, vocab, (70 if turn == 0 else 23,), generator=gen).tolist()


def _expected_cached(prompt_len: int, previous_len: int) -> int:
    """The previous turn's whole blocks (its committed tokens but the pending last) the new prompt starts
    with, leaving at least its last token to feed."""
    return (min(previous_len - 1, prompt_len - 1) // BLOCK) * BLOCK


def _counter(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def _counters() -> dict[str, float]:
    return {
        "fed": _counter("specserve_target_positions_processed_total"),
        "to_draft": _counter("specserve_coordinator_feature_bytes_total", {"hop": "to_draft"}),
        "from_target": _counter("specserve_coordinator_feature_bytes_total", {"hop": "from_target"}),
        "head_hits": _counter("specserve_prefix_cache_hits_total", {"role": "head"}),
    }


async def _chats(address: str, vocab: int) -> list[dict]:
    """Every turn of the conversations (run together): per turn, each conversation's prompt, completion and
    stats, and the counters' growth over the turn."""
    histories: dict[int, list[int]] = {c: [] for c in range(CONVERSATIONS)}
    turns = []
    for turn in range(TURNS):
        prompts = {c: histories[c] + _new_tokens(c, turn, vocab) for c in histories}
        before = _counters()
        replies = await asyncio.gather(
            *(
                sf.generate(
                    address,
                    sf.request(
                        prompts[c], max_new_tokens=MAX_NEW, gamma=GAMMA, proposer=common_pb2.PROPOSER_KIND_UNSPECIFIED
                    ),
                )
                for c in histories
            )
        )
        grown = {k: v - before[k] for k, v in _counters().items()}
        turns.append(
            {
                "previous": {c: len(histories[c]) for c in histories},
                "prompts": prompts,
                "tokens": {c: r.token_ids for c, r in zip(histories, replies, strict=True)},
                "stats": {c: r.stats for c, r in zip(histories, replies, strict=True)},
                "grown": grown,
            }
        )
        for c, reply in zip(histories, replies, strict=True):
            histories[c] = prompts[c] + reply.token_ids
    return turns


async def test_a_default_requests_history_is_neither_prefilled_again_nor_shipped_again(cached, uncached, pair):
    vocab = len(pair.tokenizer)
    row = json.loads((pair.target_dir / "config.json").read_text())["hidden_size"] * 2
    on = await _chats(cached, vocab)
    off = await _chats(uncached, vocab)
    for turn, (t_on, t_off) in enumerate(zip(on, off, strict=True)):
        fed_bound = rows_bound = 0
        history = 0
        for c in range(CONVERSATIONS):
            prompt, stats = t_on["prompts"][c], t_on["stats"][c]
            assert t_on["tokens"][c] == t_off["tokens"][c] == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW)
            assert stats.proposer == common_pb2.PROPOSER_KIND_FEATURE and t_off["stats"][c].cached_tokens == 0
            want = 0 if turn == 0 else _expected_cached(len(prompt), t_on["previous"][c])
            assert stats.cached_tokens == want, (turn, c)
            final = len(prompt) + len(t_on["tokens"][c])
            # Fed by the target: the prompt after its cached blocks, then one pending token per round or step
            # and the proposals (each round or step commits at least one token).
            fed_bound += len(prompt) - want + stats.proposed_tokens + stats.completion_tokens
            # Features: those of the positions from the last cached block on (the head's own cache may hold a
            # block fewer: its last turn's last round drafted before the final tokens).
            rows_bound += final - 1 - max(0, want - BLOCK)
            history += want
        grown = t_on["grown"]
        assert grown["fed"] <= fed_bound, (turn, grown, fed_bound)
        assert grown["to_draft"] <= rows_bound * row and grown["from_target"] <= rows_bound * row, (turn, grown)
        if turn >= 3:  # long histories: without the cache every row of the history would travel again
            assert rows_bound < history and t_off["grown"]["to_draft"] >= history * row
            assert grown["head_hits"] >= history - CONVERSATIONS * BLOCK, (turn, grown)
