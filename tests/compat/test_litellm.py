"""LiteLLM, unchanged, against ``specserve up`` as an OpenAI-compatible provider (``openai/<model>`` with
``api_base``): a chat and a stream at temperature 0; the streamed text equals the whole reply's and the
usage is the server's."""

from __future__ import annotations

import pytest
from compat_helpers import library

pytestmark = pytest.mark.system


def test_litellm_completion_and_stream(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = library("litellm")
    common = {
        "model": f"openai/{server.model}", "api_base": server.base_url, "api_key": "unused",
        "messages": [{"role": "user", "content": "def add(a, b):"}], "temperature": 0, "max_tokens": 16,
        "extra_body": {"ignore_eos": True}, "num_retries": 0, "timeout": 300,
    }  # fmt: skip
    whole = litellm.completion(**common)
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **common))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = next(c.usage for c in reversed(chunks) if getattr(c, "usage", None))
    assert usage.completion_tokens == whole.usage.completion_tokens == 16
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
