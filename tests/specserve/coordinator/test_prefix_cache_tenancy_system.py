"""The prefix cache is scoped by tenant (issue 54, finding 1; docs/design.md, "The prefix cache").

A coordinator that accepts two API keys serves the same ~200-token prompt to both: the second key finds
nothing of the first's in the target's or the draft's cache (``usage.prompt_tokens_details.cached_tokens``
and ``GenerationStats.cached_tokens`` are 0, the draft attaches nothing: no oracle of another tenant's
prompts, and no faster first token), while the same key still hits. A cache salt (``cache_salt`` over gRPC
and HTTP, ``prompt_cache_key`` over HTTP) is a scope of its own inside a key's. With
``prefix_cache_scope="shared"`` keys share on purpose. Greedy output is the target's own ``generate()``
in every case.

Real Redis, real gRPC target/draft/coordinator servers and the HTTP API, the tiny float32 pair.
"""

from __future__ import annotations

import contextlib
import uuid

import httpx
import pytest
import pytest_asyncio
import system_fixtures as sf
import torch
from prometheus_client import REGISTRY
from pydantic import SecretStr

from specserve.coordinator.server import start_coordinator
from specserve.runtime.config import CoordinatorSettings

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = {name: f"key-{name}-{uuid.uuid4().hex}" for name in ("a", "b")}
BLOCK = 16  # the workers' default prefix_block_tokens
PROMPT_TOKENS = 200
MAX_NEW = 8
#: What a second session of a 200-token prompt attaches: its whole blocks, leaving the last token to feed.
HIT = ((PROMPT_TOKENS - 1) // BLOCK) * BLOCK


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    overrides = {"auth_tokens": [SecretStr(t) for t in KEYS.values()], "http_port": 0}
    async with sf.local_stack(pair, redis_server.url, coordinator_overrides=overrides) as s:
        yield s


def _prompt(seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (PROMPT_TOKENS,), generator=gen).tolist()


def _draft_hits() -> float:
    return REGISTRY.get_sample_value("specserve_prefix_cache_hits_total", {"role": "draft"}) or 0.0


async def _http(url: str, key: str, prompt: list[int], **fields) -> tuple[str, int]:
    """One greedy completion over HTTP as ``key``: (its text, cached_tokens)."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "speculation": {"gamma": 4, "proposer": "model"},
        **fields,
    }
    async with httpx.AsyncClient(timeout=120) as http:
        reply = await http.post(f"{url}/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["usage"]["completion_tokens"] == MAX_NEW
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _grpc(address: str, key: str, prompt: list[int], salt: str = "") -> tuple[list[int], int]:
    """One greedy generation over gRPC as ``key`` with ``cache_salt``: (token ids, cached_tokens)."""
    req = sf.request(prompt, max_new_tokens=MAX_NEW, gamma=4, ignore_eos=True)
    req.cache_salt = salt
    reply = await sf.generate(address, req, metadata=(("authorization", f"Bearer {key}"),))
    return reply.token_ids, reply.stats.cached_tokens


async def test_a_second_api_key_finds_nothing_of_the_first_and_each_key_hits_its_own(stack, pair):
    url = stack.coordinator.http.url
    prompt = _prompt(1, len(pair.tokenizer))
    text, cached = await _http(url, KEYS["a"], prompt)
    assert cached == 0
    drafted = _draft_hits()
    assert await _http(url, KEYS["b"], prompt) == (text, 0)  # a's blocks are held on both workers
    assert _draft_hits() == drafted  # the draft attached none of a's blocks either
    assert await _http(url, KEYS["a"], prompt) == (text, HIT)  # the same key still hits
    assert _draft_hits() == drafted + HIT
    assert await _http(url, KEYS["b"], prompt) == (text, HIT)  # b's own first session's blocks
    # The text is the target's own greedy completion (over gRPC, as token ids).
    want = sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
    assert await _grpc(stack.address, KEYS["a"], prompt) == (want, HIT)


async def test_a_cache_salt_is_a_scope_of_its_own_within_a_key(stack, pair):
    address = stack.address
    prompt = _prompt(2, len(pair.tokenizer))
    want = sf.reference_greedy(pair.target_dir, prompt, MAX_NEW, ignore_eos=True)
    assert await _grpc(address, KEYS["a"], prompt, "s1") == (want, 0)
    assert await _grpc(address, KEYS["a"], prompt, "s1") == (want, HIT)  # the same key and salt hit
    assert await _grpc(address, KEYS["a"], prompt, "s2") == (want, 0)  # another salt misses
    assert await _grpc(address, KEYS["a"], prompt) == (want, 0)  # so does no salt
    assert await _grpc(address, KEYS["b"], prompt, "s1") == (want, 0)  # a salt never crosses keys
    # Over HTTP: cache_salt is the same salt as over gRPC; prompt_cache_key one of its own.
    url = stack.coordinator.http.url
    text, cached = await _http(url, KEYS["a"], prompt, cache_salt="s1")
    assert cached == HIT
    assert await _http(url, KEYS["a"], prompt, prompt_cache_key="s1") == (text, 0)
    assert await _http(url, KEYS["a"], prompt, prompt_cache_key="s1") == (text, HIT)


@contextlib.asynccontextmanager
async def _shared_coordinator(stack, tokenizer):
    """A second coordinator on the stack's workers with ``prefix_cache_scope="shared"``."""
    base = stack.coordinator.settings
    settings = CoordinatorSettings(
        host="127.0.0.1",
        port=0,
        http_port=0,
        redis_url=base.redis_url,
        target_endpoints=base.target_endpoints,
        draft_endpoints=base.draft_endpoints,
        auth_tokens=base.auth_tokens,
        keep_ended_sessions_s=base.keep_ended_sessions_s,
        prefix_cache_scope="shared",
    )
    app = await start_coordinator(settings, tokenizer=tokenizer)
    try:
        yield app
    finally:
        await app.stop(0.5)


async def test_keys_share_only_where_the_deployment_says_so(stack, pair):
    prompt = _prompt(3, len(pair.tokenizer))
    async with _shared_coordinator(stack, pair.tokenizer) as shared:
        url = shared.http.url
        text, cached = await _http(url, KEYS["a"], prompt)
        assert cached == 0
        assert await _http(url, KEYS["b"], prompt) == (text, HIT)  # shared on purpose
        assert await _http(url, KEYS["b"], prompt, cache_salt="x") == (text, 0)  # a salt still separates
    # The tenant-scoped coordinator on the same workers does not see the shared scope's blocks.
    assert await _http(stack.coordinator.http.url, KEYS["a"], prompt) == (text, 0)

