"""The HTTP API fuzzed from its own OpenAPI description (schemathesis), against a real coordinator.

One real stack (target, draft, coordinator with its HTTP API; tiny float32 Llama pair) runs on a loop in
a background thread, against the session's real Redis. schemathesis loads ``GET /openapi.json``
(:mod:`specserve.coordinator.openapi`) and, for every operation, generates requests that fit the schema
(positive) and requests that break it (negative: wrong types, out-of-range numbers, missing or extra
fields). Each is sent over HTTP to the running server with a deadline, and its reply must:

* not be a 5xx (``not_a_server_error``; a 503 is a fault too here: every replica is up);
* have a status and content type the description lists (``status_code_conformance``,
  ``content_type_conformance``) and a body that fits it (``response_schema_conformance``);
* if it is an error, be OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``;
* if the request broke the schema, be refused with a 4xx (``negative_data_rejection``);
* arrive before the deadline (no hang).

Afterwards the coordinator still serves a well-formed request. Bounded: ``MAX_EXAMPLES`` per operation
and mode, no example database. The counts are printed (``-s``) for docs/reliability.md.

Beside the drawn requests, :data:`HOSTILE_BODIES` are sent as they are (issue 54): bodies a JSON parser
or what follows it could choke on (nesting past the recursion limit, numbers too large for any field,
invalid UTF-8, a lone surrogate, duplicate keys, deep nesting inside a field, a schema nested 1,000
deep or of 1 MB): each is a 400 in OpenAI's shape whose ``code`` and message name the problem.
"""

from __future__ import annotations

import json
from collections import Counter

import grpc
import httpx
import pytest
import schemathesis
import system_fixtures as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import CLEAN_CODES, LoopThread
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.system

MAX_EXAMPLES = 40  # per HTTP operation and mode
GRPC_EXAMPLES = 40  # per gRPC method
MAX_NEW_LIMIT = 16  # the coordinator's max_new_tokens_limit (completions ask for 16 by default): replies stay short
REQUEST_TIMEOUT_S = 60.0  # a reply later than this is a hang
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    """A running LocalStack (its loop in a thread): coordinator with its HTTP API, one target, one draft."""
    from specserve.launch.local import start_local_stack

    pair = sf.tiny_pair(tmp_path_factory)
    loop = LoopThread()
    no_warmup = {"warmup": False}

    async def start():
        return await start_local_stack(
            target_model=pair.target_dir,
            draft_model=pair.draft_dir,
            redis_url=redis_server.url,
            device="cpu",
            dtype="float32",
            target_overrides=no_warmup,
            draft_overrides=no_warmup,
            coordinator_overrides={
                "http_port": 0,
                "max_new_tokens_limit": MAX_NEW_LIMIT,
                "default_max_new_tokens": MAX_NEW_LIMIT,
                "max_prompt_tokens": 64,
            },
        )

    stack = loop.run(start(), timeout_s=300)
    yield stack
    loop.run(stack.stop(grace=0.5), timeout_s=60)
    loop.close()


@pytest.fixture(scope="module")
def http_url(stack) -> str:
    return stack.coordinator.http.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def grpc_addresses(stack) -> dict[str, str]:
    return {
        "coordinator": stack.address,
        "draft": f"127.0.0.1:{stack.draft_port}",
        "target": f"127.0.0.1:{stack.target_ports[0]}",
    }


def _assert_openai_error(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_the_description_covers_every_route_with_its_bodies(http_url):
    document = httpx.get(f"{http_url}/openapi.json", timeout=30).json()
    assert set(document["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/version",
        "/metrics",
    }
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        post = document["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        body = document["components"]["schemas"][model]
        assert body["additionalProperties"] is False
        assert {"max_tokens", "temperature", "top_p", "n", "stream", "seed"} <= set(body["properties"])
        assert {"200", "400", "413", "429"} <= set(post["responses"])


def _deep(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def _schema_format(schema_text: str) -> str:
    return '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + schema_text + "}}"


#: name -> (route, body, OpenAI ``code``, words of the message). Each was a 500, or a 200 or a 400 that
#: did not say what was wrong, before issue 54.
HOSTILE_BODIES: dict[str, tuple[str, bytes, str, str]] = {
    "arrays 5,000 deep": ("/v1/completions", b"[" * 5000 + b"]" * 5000, "too_deep", "more than 64 levels"),
    "a field 5,000 deep": (
        "/v1/completions",
        b'{"prompt": "x", "logit_bias": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
        "too_deep",
        "more than 64 levels",
    ),
    "a field 100 deep": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": ' + b"[" * 100 + b"]" * 100 + b"}]}",
        "too_deep",
        "the field 'messages' nests",
    ),
    "a schema 1,000 deep": (
        "/v1/chat/completions",
        ('{"messages": [{"role": "user", "content": "hi"}], "response_format": ' + _schema_format(_deep(1000)) + "}")
        .encode(),
        "too_deep",
        "levels",
    ),
    "a schema 70 deep": (
        "/v1/chat/completions",
        ('{"messages": [{"role": "user", "content": "hi"}], "response_format": ' + _schema_format(_deep(70)) + "}")
        .encode(),
        "too_deep",
        "the field 'response_format' nests",
    ),
    "a schema of 1 MB": (
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": json.loads(_schema_format(json.dumps({"description": "x" * 1_000_000}))),
            }
        ).encode(),
        "invalid_value",
        "at most 65536 are accepted",
    ),
    "a 100,000-value enum": (
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": json.loads(_schema_format(json.dumps({"enum": list(range(100_000))}))),
            }
        ).encode(),
        "invalid_value",
        "at most 65536 are accepted",
    ),
    "1e999999": ("/v1/completions", b'{"prompt": "x", "temperature": 1e999999}', "number_too_large", "out of range"),
    "a 100,000-digit integer": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": ' + b"7" * 100_000 + b"}",
        "number_too_large",
        "100000 digits",
    ),
    "NaN": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "invalid_number", "not JSON"),
    "invalid UTF-8": ("/v1/completions", b'{"prompt": "caf\xe9 \xff"}', "invalid_encoding", "not valid UTF-8"),
    "a lone surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}',
        "invalid_encoding",
        "lone UTF-16 surrogate",
    ),
    "a duplicate key": ("/v1/completions", b'{"prompt": "x", "max_tokens": 1, "max_tokens": 9}', "duplicate_key", "twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BODIES), ids=list(HOSTILE_BODIES))
def test_a_hostile_body_is_a_400_naming_the_problem(http_url, case):
    route, body, code, words = HOSTILE_BODIES[case]
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{http_url}{route}", content=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400, response.text[:500]
    _assert_openai_error(response)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code and words in error["message"], error
    good = httpx.post(f"{http_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=REQUEST_TIMEOUT_S)
    assert good.status_code == 200, good.text


def _fuzz(operation, mode, http_url: str, tried: Counter[str], statuses: Counter[str]) -> None:
    """``MAX_EXAMPLES`` requests to ``operation`` drawn in ``mode``, each sent and checked."""
    label = f"{operation.method.upper()} {operation.path} {mode.value}"

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(base_url=http_url, timeout=REQUEST_TIMEOUT_S)
        tried[label] += 1
        statuses[str(response.status_code)] += 1
        if response.status_code >= 400 and mode is GenerationMode.POSITIVE:
            print("POS400", response.json()["error"]["message"][:150].replace("\n", " "))
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            _assert_openai_error(response)

    run()


def test_every_operation_fuzzed_from_the_schema_gets_a_clean_answer(http_url):
    schema = schemathesis.openapi.from_url(f"{http_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    tried: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # the GET routes take no parameters: nothing to break

            _fuzz(operation, mode, http_url, tried, statuses)
    print("\nschemathesis cases:", json.dumps(dict(sorted(tried.items())), indent=1))
    print("statuses:", dict(sorted(statuses.items())), "total:", sum(tried.values()))
    assert len(operations) == 6
    reply = httpx.post(
        f"{http_url}/v1/completions",
        json={"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


# --------------------------------------------------------------------------- gRPC, from the proto descriptors


def _scalar(field) -> st.SearchStrategy:
    """Values of one scalar proto field: small ones (token ids, lengths, versions) and the type's extremes."""
    from google.protobuf.descriptor import FieldDescriptor as F

    def ints(lo: int, hi: int) -> st.SearchStrategy:
        return st.one_of(st.integers(max(lo, -2), min(hi, 400)), st.sampled_from([lo, hi]), st.integers(lo, hi))

    kind = field.type
    if kind in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return ints(0, 2**32 - 1)
    if kind in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return ints(0, 2**64 - 1)
    if kind in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return ints(-(2**31), 2**31 - 1)
    if kind in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return ints(-(2**63), 2**63 - 1)
    if kind == F.TYPE_ENUM:  # known values and unknown ones
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-(2**31), 2**31 - 1))
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        special = st.sampled_from([0.0, 1.0, -1.0, 0.5, float("nan"), float("inf"), -float("inf"), 1e-45, 3.4e38])
        return st.one_of(special, st.floats(width=32 if kind == F.TYPE_FLOAT else 64))
    if kind == F.TYPE_BOOL:
        return st.booleans()
    if kind == F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(["", "def add(a, b):", "user", "x" * 5000]))
    if kind == F.TYPE_BYTES:
        return st.binary(max_size=64)
    raise AssertionError(f"no strategy for {field.full_name} (type {kind})")


@st.composite
def proto_message(draw, descriptor, depth: int = 0):
    """A message of ``descriptor``'s type, every field drawn from its declared type (set or left out; one
    member per oneof; up to 6 items per repeated field; nested messages 4 deep)."""
    from google.protobuf import message_factory
    from google.protobuf.descriptor import FieldDescriptor as F

    message = message_factory.GetMessageClass(descriptor)()
    chosen = {oneof.name: draw(st.sampled_from([None, *oneof.fields])) for oneof in descriptor.oneofs}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen[oneof.name] is not field:
            continue
        if oneof is None and not draw(st.booleans()):
            continue
        if field.type == F.TYPE_MESSAGE:
            if depth >= 4:
                continue
            items = proto_message(field.message_type, depth + 1)
            if field.is_repeated:
                getattr(message, field.name).extend(draw(st.lists(items, max_size=3)))
            else:
                getattr(message, field.name).CopyFrom(draw(items))
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=6)))
        else:
            setattr(message, field.name, draw(_scalar(field)))
    return message


def _methods(address_of: dict[str, str]) -> list[tuple[str, str, object, bool]]:
    """(address, full method path, request descriptor, server-streaming) of every method of the three services."""
    from specserve.v1 import coordinator_pb2, draft_pb2, target_pb2

    found = []
    for module, role in ((coordinator_pb2, "coordinator"), (draft_pb2, "draft"), (target_pb2, "target")):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                found.append((address_of[role], path, method.input_type, method.server_streaming))
    return found


def _fuzz_method(address: str, path: str, descriptor, streaming: bool, tried: Counter[str], codes: Counter[str]) -> None:
    """``GRPC_EXAMPLES`` calls of one method with requests drawn from its input descriptor, each checked."""
    channel = grpc.insecure_channel(address)
    call = (channel.unary_stream if streaming else channel.unary_unary)(
        path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=lambda b: b
    )

    @given(request=proto_message(descriptor))
    @settings(max_examples=GRPC_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(request) -> None:
        try:
            reply = call(request, timeout=REQUEST_TIMEOUT_S)
            if streaming:
                list(reply)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            assert code in CLEAN_CODES, f"{path}: {code.name}: {details}\nrequest: {str(request)[:1500]}"
        tried[path] += 1
        codes[code.name] += 1

    try:
        run()
    finally:
        channel.close()


def test_every_grpc_method_fuzzed_from_its_proto_gets_a_clean_status(grpc_addresses):
    """Every method of CoordinatorService, DraftService and TargetService, with requests drawn from their
    descriptors: each call ends OK or with a status naming the caller's mistake (never INTERNAL, UNKNOWN,
    UNAVAILABLE) before its deadline, and the coordinator still serves a good request afterwards."""
    tried: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    methods = _methods(grpc_addresses)
    assert len(methods) == 8
    for address, path, descriptor, streaming in methods:
        _fuzz_method(address, path, descriptor, streaming, tried, codes)
    print("\ngRPC cases:", json.dumps(dict(sorted(tried.items())), indent=1))
    print("codes:", dict(sorted(codes.items())), "total:", sum(tried.values()))
    from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(grpc_addresses["coordinator"]) as channel:
        request = coordinator_pb2.GenerateRequest(
            text="def add(a, b):", stop=common_pb2.StopConditions(max_new_tokens=4, ignore_eos=True)
        )
        replies = list(coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=60))
    assert sum(len(r.chunk.token_ids) for r in replies) == 4
