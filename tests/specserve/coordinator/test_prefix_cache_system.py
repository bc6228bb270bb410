"""The prefix cache through the whole system (docs/design.md, "The prefix cache").

Greedy multi-turn chats (each turn's prompt is the last turn's prompt, its completion and new tokens)
run on two stacks, the prefix cache on (the default) and off, alone and four conversations at a time
(batched verify passes): every turn's completion is token-identical on both and equal to stock
transformers ``generate()``. ``cached_tokens`` is the number of prompt tokens the target did not feed.

Real Redis, real gRPC target/draft/coordinator servers, the tiny float32 pair.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from prometheus_client import REGISTRY

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 16  # the workers' default prefix_block_tokens
TURNS = 4
NEW_PER_TURN = 23  # new prompt tokens per turn (not a whole number of blocks)
MAX_NEW = 10


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(pair, redis_server):
    """(cache on, cache off): two systems on the same Redis."""
    async with (
        sf.local_stack(pair, redis_server.url) as on,
        sf.local_stack(pair, redis_server.url, worker_overrides={"prefix_cache": False}) as off,
    ):
        yield on, off


def _new_tokens(conversation: int, turn: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * conversation + turn)
    return torch.randint(1, vocab, (NEW_PER_TURN + (7 if turn == 0 else 0),), generator=gen).tolist()


async def _chats(
    address: str, conversations: list[int], vocab: int
) -> dict[int, list[tuple[list[int], object]]]:
    """Each conversation's turns, the conversations of a turn run concurrently: per conversation a list of
    (completion, stats) per turn."""
    history: dict[int, list[int]] = {c: [] for c in conversations}
    out: dict[int, list[tuple[list[int], object]]] = {c: [] for c in conversations}
    for turn in range(TURNS):
        prompts = {c: history[c] + _new_tokens(c, turn, vocab) for c in conversations}
        replies = await asyncio.gather(
            *(
                sf.generate(address, sf.request(prompts[c], max_new_tokens=MAX_NEW, gamma=4))
                for c in conversations
            )
        )
        for c, reply in zip(conversations, replies, strict=True):
            out[c].append((reply.token_ids, reply.stats))
            history[c] = prompts[c] + reply.token_ids
    return out


def _expected_cached(prompt_len: int, previous_len: int) -> int:
    """Whole blocks of the previous turn's cached tokens (its committed tokens but the last, pending one)
    that the new prompt starts with, leaving at least its last token to feed."""
    return (min(previous_len - 1, prompt_len - 1) // BLOCK) * BLOCK


@pytest.mark.parametrize("together", [1, 4], ids=["alone", "batched"])
async def test_every_turn_is_token_identical_with_the_cache_on_and_off(stacks, pair, together):
    on, off = stacks
    vocab = len(pair.tokenizer)
    conversations = list(range(10 * together, 10 * together + together))
    draft_hits = _hits("draft")
    got_on = await _chats(on.address, conversations, vocab)
    assert _hits("draft") > draft_hits  # the draft attaches the history too
    got_off = await _chats(off.address, conversations, vocab)
    for c in conversations:
        history: list[int] = []
        for turn, ((tokens_on, stats_on), (tokens_off, stats_off)) in enumerate(
            zip(got_on[c], got_off[c], strict=True)
        ):
            prompt = history + _new_tokens(c, turn, vocab)
            assert tokens_on == tokens_off == sf.reference_greedy(pair.target_dir, prompt, MAX_NEW)
            assert stats_off.cached_tokens == 0
            want = 0 if turn == 0 else _expected_cached(len(prompt), len(history))
            assert stats_on.cached_tokens == want, (c, turn)
            history = prompt + tokens_on
        assert got_on[c][-1][1].cached_tokens > 3 * BLOCK  # the last turns start from cached history


def _target_positions() -> float:
    return REGISTRY.get_sample_value("specserve_target_positions_processed_total") or 0.0


def _hits(role: str) -> float:
    return REGISTRY.get_sample_value("specserve_prefix_cache_hits_total", {"role": role}) or 0.0


async def test_cached_tokens_are_the_prompt_tokens_the_target_did_not_feed(stacks, pair):
    """One target step (gamma 0, one token): the target feeds the prompt's tokens it lacks, no more."""
    on, _ = stacks
    vocab = len(pair.tokenizer)
    first = _new_tokens(99, 0, vocab) * 3  # 90 tokens
    reply = await sf.generate(on.address, sf.request(first, max_new_tokens=1, gamma=0, ignore_eos=True))
    assert reply.stats.cached_tokens == 0
    follow = [*first, *reply.token_ids, *_new_tokens(99, 1, vocab)]
    before, hits = _target_positions(), _hits("target")
    again = await sf.generate(on.address, sf.request(follow, max_new_tokens=1, gamma=0, ignore_eos=True))
    fed = _target_positions() - before
    cached = again.stats.cached_tokens
    assert cached == _expected_cached(len(follow), len(first) + 1) == 80
    assert fed == len(follow) - cached
    assert _hits("target") - hits == cached
    queries = REGISTRY.get_sample_value("vllm:prefix_cache_queries_total", {"role": "target"})
    assert queries is not None and queries >= len(follow)  # vLLM's name, the same counter
