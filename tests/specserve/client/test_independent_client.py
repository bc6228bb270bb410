"""An independent client drives the coordinator: ``buf curl`` (Go, connect-go), not our SDK or stubs.

It learns the schema from the coordinator's server reflection, calls the
standard health check (unary) and streams a generation; the streamed greedy
tokens must equal the target model's own ``generate(do_sample=False)``.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import pytest_asyncio

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        shutil.which("buf") is None,
        reason="buf is not installed (npm install -g @bufbuild/buf): it is the independent gRPC client here",
    ),
]

PROMPT_TOKENS = [5, 17, 42, 99, 7]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory):
    import system_fixtures as sf

    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(redis_server, pair):
    import system_fixtures as sf

    async with sf.local_stack(pair, redis_server.url) as s:
        yield s


async def buf_curl(address: str, method: str, body: dict) -> tuple[int, list[dict], str]:
    """Run ``buf curl`` over plaintext HTTP/2 gRPC; returns its exit status and the JSON documents it printed."""
    proc = await asyncio.create_subprocess_exec(
        shutil.which("buf"),
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        f"http://{address}/{method}",
        "-d",
        json.dumps(body),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, json_documents(out.decode()), err.decode()


def json_documents(text: str) -> list[dict]:
    """The JSON documents printed one after another (buf curl prints one per message)."""
    docs, decoder, i = [], json.JSONDecoder(), 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return docs
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)


async def test_unary_health_check(stack):
    code, docs, err = await buf_curl(stack.address, "grpc.health.v1.Health/Check", {})
    assert code == 0, err
    assert docs == [{"status": "SERVING"}]
    code, docs, err = await buf_curl(
        stack.address, "grpc.health.v1.Health/Check", {"service": "specserve.v1.CoordinatorService"}
    )
    assert code == 0, err
    assert docs == [{"status": "SERVING"}]


async def test_streamed_generation_equals_the_target_alone(stack, pair):
    import system_fixtures as sf

    body = {
        "tokens": {"tokenIds": PROMPT_TOKENS},
        "sampling": {"temperature": 0},
        "stop": {"maxNewTokens": 10, "ignoreEos": True},
        "speculation": {"gamma": 3},
    }
    code, docs, err = await buf_curl(stack.address, "specserve.v1.CoordinatorService/Generate", body)
    assert code == 0, err
    *chunks, last = docs
    assert chunks and all(set(d) == {"chunk"} for d in chunks)
    assert set(last) == {"stats"}
    streamed = [t for d in chunks for t in d["chunk"].get("tokenIds", [])]

    expected = await asyncio.to_thread(
        sf.reference_greedy, pair.target_dir, PROMPT_TOKENS, 10, eos_token_id=-1
    )
    assert streamed == expected
    stats = last["stats"]
    assert stats["completionTokens"] == 10
    assert stats["finishReason"] == "FINISH_REASON_LENGTH"
    assert int(stats["rounds"]) >= 1


async def test_an_invalid_request_gets_invalid_argument(stack):
    body = {"text": "def f():", "sampling": {"temperature": -1}}
    code, docs, err = await buf_curl(stack.address, "specserve.v1.CoordinatorService/Generate", body)
    assert code != 0
    assert docs == []
    error = json_documents(err)[-1]  # buf curl prints the status on stderr
    assert error["code"] == "invalid_argument"
    assert "temperature must be >= 0" in error["message"]
