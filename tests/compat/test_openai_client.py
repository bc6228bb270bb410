"""The official ``openai`` package, unchanged, against ``specserve up``: chat and completions, each
streamed (with usage) and not, at temperature 0; the streamed text equals the whole reply's and the usage
is the server's."""

from __future__ import annotations

import pytest
from compat_helpers import library

pytestmark = pytest.mark.system

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def _usage(usage) -> dict:
    """The usage but its cached tokens: the second of two equal prompts may find the first's blocks in the prefix
    cache (whole blocks, never more than the prompt), and whether it does depends on when the first released."""
    got = usage.model_dump()
    cached = (got.pop("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached % 16 == 0 and cached <= usage.prompt_tokens
    return got


def test_openai_chat_and_completions_streamed_and_not(server):
    openai = library("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    common = {"model": server.model, "temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(messages=MESSAGES, **common)
    chunks = list(
        client.chat.completions.create(messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **common)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert _usage(chunks[-1].usage) == _usage(whole.usage) and whole.usage.completion_tokens == 16

    text = client.completions.create(prompt="class Point:", **common)
    pieces = list(
        client.completions.create(prompt="class Point:", stream=True, stream_options={"include_usage": True}, **common)
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == text.choices[0].text
    assert _usage(pieces[-1].usage) == _usage(text.usage) and text.usage.completion_tokens == 16
    assert [m.id for m in client.models.list()] == [server.model]
