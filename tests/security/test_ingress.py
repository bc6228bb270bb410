"""What one client sends cannot hurt another's sessions: request ids are cleaned and capped at ingress,
HTTP bodies are sized before they are parsed, and every out-of-range field is a 400 (HTTP) or
INVALID_ARGUMENT (gRPC), never a 500.

One stack for the module: target, draft and coordinator (gRPC and HTTP) on loopback, the coordinator
waiting up to half a second for batch-mates so that concurrent sessions share Verify calls. Logging is
configured as the entry points do (JSON) into a buffer, to read which request ids each role saw.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import threading

import grpc
import httpx
import pytest
import pytest_asyncio
import structlog
import system_fixtures as sf
from security_helpers import running_roles

from specserve.runtime.interceptors import MAX_REQUEST_ID_CHARS, MAX_REQUEST_IDS_CHARS
from specserve.runtime.logs import configure_logging
from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

PROMPT = [5, 6, 7, 8]
#: Each id alone is under gRPC's 16 KiB metadata limit; two joined are over it.
BIG_ID_CHARS = 9 * 1024
#: Under gRPC's 8 KiB soft limit of a call's metadata (past it a server refuses some calls at random).
GRPC_ID_CHARS = 7 * 1024
MAX_PROMPT_TOKENS = 64


@pytest.fixture(scope="module")
def captured_logs():
    buffer = io.StringIO()
    configure_logging("json", "debug", stream=buffer)
    yield buffer
    structlog.reset_defaults()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(captured_logs, sec_pair, sec_models, redis_server):
    coordinator = {
        "http_port": 0,
        "max_batch_wait_ms": 500.0,
        "max_prompt_tokens": MAX_PROMPT_TOKENS,
        "max_message_bytes": 4 * 1024 * 1024,
        "max_prompt_bytes": 512 * 1024,
    }
    async with running_roles(sec_pair, sec_models, redis_server.url, coordinator=coordinator) as r:
        yield r


@pytest.fixture
def url(roles) -> str:
    return roles.coordinator.http.url


def _events(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines() if line.startswith("{")]


# --------------------------------------------------------------------------- request ids


def _ids_seen(buffer: io.StringIO) -> dict[str | None, list[set[str]]]:
    """By RPC, the request ids of each logged event."""
    seen: dict[str | None, list[set[str]]] = {}
    for event in _events(buffer):
        seen.setdefault(event.get("rpc"), []).append(set((event.get("request_id") or "").split(",")))
    return seen


def _check_batched(buffer: io.StringIO, cut: list[str]) -> None:
    """Each id reached the workers cut, some Verify call carried them all, and no event's joined value
    is past the cap."""
    seen = _ids_seen(buffer)
    for rpc in ("Verify", "ProposeBatch"):
        assert set(cut) <= set().union(*seen[rpc]), rpc
    assert any(set(cut) <= ids for ids in seen["Verify"]), "the sessions shared a Verify call"
    assert all(len(e.get("request_id") or "") <= MAX_REQUEST_IDS_CHARS for e in _events(buffer))


async def test_two_9_kib_request_ids_in_one_verify_batch_fail_neither_session(url, captured_logs):
    """The review's case, over HTTP: two ~9 KiB ids (one metadata value of 18 KiB once joined, over gRPC's
    16 KiB limit). Each is cut at the coordinator's ingress and the batch's joined value is capped, so both
    sessions, batched together, are served."""
    ids = [c * BIG_ID_CHARS for c in "ab"]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "speculation": {"gamma": 2}}
    async with httpx.AsyncClient(timeout=120) as http:
        replies = await asyncio.gather(
            *(http.post(f"{url}/completions", json=body, headers={"x-request-id": i}) for i in ids)
        )
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert [r.json()["usage"]["completion_tokens"] for r in replies] == [8, 8]
    cut = [c * MAX_REQUEST_ID_CHARS for c in "ab"]
    assert [r.headers["x-request-id"] for r in replies] == cut
    _check_batched(captured_logs, cut)


async def test_long_grpc_request_ids_are_cut_and_a_batch_of_them_is_served(roles, captured_logs):
    """Over gRPC: three ~7 KiB ids (each under gRPC's own 8 KiB soft limit at the coordinator; 21 KiB
    once joined), one of them with a space (no part of an id)."""
    ids = ["c" * GRPC_ID_CHARS, "d d" + "d" * GRPC_ID_CHARS, "e" * GRPC_ID_CHARS]
    request = sf.request(PROMPT, max_new_tokens=8, gamma=2, ignore_eos=True)
    outs = await asyncio.gather(
        *(sf.generate(roles.address, request, metadata=(("x-request-id", i),)) for i in ids)
    )
    assert [len(out.token_ids) for out in outs] == [8, 8, 8]
    cut = [c * MAX_REQUEST_ID_CHARS for c in "cde"]
    assert set(cut) <= set().union(*_ids_seen(captured_logs)["Generate"])
    _check_batched(captured_logs, cut)


# --------------------------------------------------------------------------- sizes before work


async def test_a_token_prompt_over_the_limit_is_refused_naming_the_field_before_it_is_built(url):
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(f"{url}/completions", json={"prompt": [5] * 200_000, "max_tokens": 2})
        messages = [{"role": "user", "content": "hi"}] * 100_000
        chat = await http.post(f"{url}/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and f"limit of {MAX_PROMPT_TOKENS}" in error["message"]
    assert "200000" in error["message"]
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages"


def _frames_of(name: str, filename: str, seen: set[int], stop: threading.Event) -> None:
    """Until ``stop``: add to ``seen`` the id of every thread found running function ``name`` of ``filename``."""
    while not stop.wait(0.001):
        for thread_id, frame in sys._current_frames().items():
            f = frame
            while f is not None:
                if f.f_code.co_name == name and f.f_code.co_filename.endswith(filename):
                    seen.add(thread_id)
                f = f.f_back


async def test_a_large_body_is_parsed_and_validated_off_the_event_loop(url):
    """The review's case: 100k messages (about 3 MB, under every size limit) take the validator a while;
    meanwhile the coordinator's event loop (this test's: the servers run in it) must stay free. A thread
    watching every thread's stack sees the validation (``parse_body``) run, never on the loop's thread."""
    messages = [{"role": "user", "content": ""}] * 100_000
    body = {"messages": messages, "max_tokens": 2, "not_a_field": True}  # refused once validated
    seen: set[int] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_frames_of, args=("parse_body", "openai_protocol.py", seen, stop))
    watcher.start()
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            reply = await http.post(f"{url}/chat/completions", json=body)
    finally:
        stop.set()
        watcher.join()
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "not_a_field", reply.text
    assert seen, "the validation was seen running"
    assert threading.get_ident() not in seen, "the validation ran on the event loop's thread"


async def test_n_over_the_session_limits_is_refused_before_any_prompt_is_tokenized(url):
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(f"{url}/completions", json={"prompt": "x" * 1000, "n": 10**6, "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


async def test_a_body_without_a_length_is_counted_as_it_arrives(url, roles):
    limit = roles.coordinator.settings.max_message_bytes

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(f"{url}/completions", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


# --------------------------------------------------------------------------- out-of-range fields

#: Fields whose value is out of the range the wire or the model takes: each must be a 400 naming it.
OUT_OF_RANGE = [
    ("max_tokens", 2**32),
    ("max_tokens", 2**70),
    ("max_completion_tokens", 2**32),
    ("n", 2**63),
    ("seed", 2**64),
    ("seed", -1),
    ("top_k", 2**32),
    ("top_k", 2**64),
    ("temperature", 1e300),
    ("temperature", -1),
    ("top_p", 2.0),
    ("min_p", 1e40),
    ("repetition_penalty", 1e39),
    ("logprobs", 2**40),
    ("top_logprobs", 2**40),
    ("stop_token_ids", [2**32]),
    ("speculation", {"gamma": 2**32}),
    ("speculation", {"gamma": 2**64}),
    ("speculation", {"draft_top_k": 2**32}),
    ("speculation", {"min_confidence": 1e300}),
]


@pytest.mark.parametrize("field, value", OUT_OF_RANGE)
async def test_every_out_of_range_field_is_a_400_in_openais_shape(url, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    if field == "logprobs":
        body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": value}
    if field == "top_logprobs":
        body["logprobs"] = True
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(f"{url}/chat/completions" if "messages" in body else f"{url}/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"] or "").split(".")[0] == field, error


async def test_non_finite_json_numbers_are_a_400(url):
    for literal in ("NaN", "Infinity", "-Infinity"):
        raw = '{"prompt": [5, 6], "max_tokens": 2, "temperature": ' + literal + "}"
        async with httpx.AsyncClient(timeout=60) as http:
            reply = await http.post(f"{url}/completions", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 400, (literal, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"


def _grpc_cases() -> list[coordinator_pb2.GenerateRequest]:
    def req(**sampling) -> coordinator_pb2.GenerateRequest:
        pb = sf.request(PROMPT, max_new_tokens=2)
        for name, value in sampling.items():
            setattr(pb.sampling, name, value)
        return pb

    cases = [
        req(temperature=float("nan")),
        req(temperature=float("inf")),
        req(top_p=float("nan")),
        req(min_p=float("-inf")),
        req(repetition_penalty=float("inf")),
        req(top_k=2**32 - 1, temperature=1.0, min_p=2.0),
    ]
    huge = sf.request(PROMPT, max_new_tokens=2**32 - 1)
    gamma = sf.request(PROMPT, max_new_tokens=2, gamma=2**32 - 1)
    confidence = sf.request(PROMPT, max_new_tokens=2)
    confidence.speculation.min_confidence = float("nan")
    draft_top_k = sf.request(PROMPT, max_new_tokens=2)
    draft_top_k.speculation.draft_top_k = 2**32 - 1
    logprobs = sf.request(PROMPT, max_new_tokens=2)
    logprobs.logprobs.top_logprobs = 2**32 - 1
    stop = sf.request(PROMPT, max_new_tokens=2)
    stop.stop.stop_token_ids.append(2**32 - 1)
    proposer = sf.request(PROMPT, max_new_tokens=2)
    proposer.speculation.proposer = 2**31 - 1
    mode = sf.request(PROMPT, max_new_tokens=2)
    mode.sampling.sampling_mode = common_pb2.SamplingMode.ValueType(2**31 - 1)
    return [*cases, huge, gamma, confidence, draft_top_k, logprobs, stop, proposer, mode]


async def test_every_out_of_range_grpc_field_is_invalid_argument(roles):
    async with grpc.aio.insecure_channel(roles.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        for pb in _grpc_cases():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(pb, timeout=30):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (pb, info.value.details())
