"""LangChain's ``ChatOpenAI``, unchanged, against ``specserve up``: a chat and a stream at temperature 0;
the streamed text equals the whole reply's, and both report the server's token counts."""

from __future__ import annotations

import pytest
from compat_helpers import library, served_again

pytestmark = pytest.mark.system


def test_langchain_chat_openai_invoke_and_stream(server):
    library("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=server.model, base_url=server.base_url, api_key="unused", temperature=0, max_tokens=16,
        max_retries=0, timeout=300, stream_usage=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    question = [("user", "def add(a, b):")]
    whole = llm.invoke(question)
    streamed = None
    for chunk in llm.stream(question):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.content == whole.content
    again = served_again(
        server.base_url,
        "chat/completions",
        {"model": server.model, "messages": [{"role": "user", "content": "def add(a, b):"}], "temperature": 0,
         "max_tokens": 16, "ignore_eos": True},
    )  # fmt: skip
    assert whole.content == again["choices"][0]["message"]["content"]
    usage = again["usage"]
    for message in (whole, streamed):
        assert message.usage_metadata["input_tokens"] == usage["prompt_tokens"]
        assert message.usage_metadata["output_tokens"] == usage["completion_tokens"] == 16
