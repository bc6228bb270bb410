"""The client SDK.

Part 1 runs the SDK against ``ScriptedCoordinator``, a **fake** coordinator (a
real gRPC server on loopback, hosted by the real ``create_server`` with its
error interceptor) whose replies are scripted by the prompt text. It pins down
what needs exact control of the wire: the status-code mapping, retries before
and after the first token, metadata and request building.

Part 2 runs the SDK against the real system (coordinator, draft, target, Redis).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import grpc
import pytest
import pytest_asyncio

from specserve import AsyncClient, Client
from specserve.api import errors
from specserve.client import ERROR_CLASS_KEY, ERRORS_BY_CODE, GenerationParams, build_request, error_from_rpc
from specserve.runtime.config import CommonSettings
from specserve.runtime.server import Registration, create_server
from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

# One event loop per module for async tests: the real stack below is started once for all of them.
module_loop = pytest.mark.asyncio(loop_scope="module")

# --------------------------------------------------------------------------- the fake coordinator


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """A fake coordinator: the prompt text says what to do.

    * ``ok:<n>``: stream tokens 10..10+n one per chunk (text ``t<id>``), then stats.
    * ``raise:<Class>``: raise that domain error (the server interceptor maps it).
    * ``named:<Class>``: abort with the class's code and name it in trailing metadata.
    * ``flaky:<k>:<n>``: UNAVAILABLE for the first k calls with this text, then ``ok:<n>``.
    * ``exhausted:<k>:<hint>:<n>``: RESOURCE_EXHAUSTED with a retry hint of ``hint`` seconds for the
      first k calls with this text, then ``ok:<n>``.
    * ``chunk-then-unavailable``: one chunk, then UNAVAILABLE.
    * ``hang``: one chunk, then wait until cancelled.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.arrivals: dict[str, list[float]] = {}  # text -> time.monotonic() of each call
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        text = request.text
        self.calls.append((text, dict(context.invocation_metadata())))
        self.arrivals.setdefault(text, []).append(time.monotonic())
        verb, _, arg = text.partition(":")
        if verb == "raise":
            cls = {c.__name__: c for c in errors.all_error_classes()}[arg]
            raise cls(f"{arg} because of the script")
        if verb == "named":
            cls = {c.__name__: c for c in errors.all_error_classes()}[arg]
            context.set_trailing_metadata(((ERROR_CLASS_KEY, arg),))
            await context.abort(grpc.StatusCode[cls.grpc_code_name], f"{arg} named by the script")
        if verb == "flaky":
            k, n = (int(x) for x in arg.split(":"))
            if sum(1 for t, _ in self.calls if t == text) <= k:
                raise errors.Unavailable("the script says: not yet")
            arg = str(n)
        if verb == "exhausted":
            k, hint, n = arg.split(":")
            if sum(1 for t, _ in self.calls if t == text) <= int(k):
                raise errors.ResourceExhausted("the script says: slow down", retry_after_s=float(hint))
            arg = n
        if verb == "chunk-then-unavailable":
            yield chunk_response([1])
            raise errors.Unavailable("the script drops the stream after one chunk")
        if verb == "hang":
            yield chunk_response([1])
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        n = int(arg)
        for tok in range(10, 10 + n):
            yield chunk_response([tok])
        yield coordinator_pb2.GenerateResponse(
            stats=coordinator_pb2.GenerationStats(
                session_id="s-1",
                prompt_tokens=3,
                completion_tokens=n,
                rounds=2,
                proposed_tokens=8,
                accepted_tokens=6,
                accepted_per_position=[2, 2, 1, 1],
                draft_ns=1_000_000,
                verify_ns=3_000_000,
                queue_ns=500_000,
                first_token_ns=2_000_000,
                total_ns=5_000_000_000,
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                seed=7,
            )
        )


def chunk_response(tokens: list[int]) -> coordinator_pb2.GenerateResponse:
    return coordinator_pb2.GenerateResponse(
        chunk=coordinator_pb2.TokenChunk(token_ids=tokens, text="".join(f"t{t}" for t in tokens))
    )


@pytest_asyncio.fixture(loop_scope="module")
async def fake():
    servicer = ScriptedCoordinator()
    running = await create_server(
        CommonSettings(host="127.0.0.1", port=0),
        [
            Registration(
                coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                servicer,
                "specserve.v1.CoordinatorService",
            )
        ],
    )
    servicer.address = f"127.0.0.1:{running.port}"
    yield servicer
    await running.stop(0)


# --------------------------------------------------------------------------- error mapping


@pytest.mark.unit
def test_every_status_code_but_ok_maps_to_an_sdk_error():
    codes = set(grpc.StatusCode) - {grpc.StatusCode.OK}
    assert set(ERRORS_BY_CODE) == codes
    for code, cls in ERRORS_BY_CODE.items():
        assert issubclass(cls, errors.SpecServeError), code


@pytest.mark.unit
def test_every_error_class_is_reachable_from_its_code():
    """The code alone yields the class or its base; the class name in metadata yields the class."""
    for cls in errors.all_error_classes():
        mapped = ERRORS_BY_CODE[grpc.StatusCode[cls.grpc_code_name]]
        assert issubclass(cls, mapped), (cls, mapped)
        # Classes that own a code (not a refinement of one) are what the code gives back.
        if cls.__base__ is errors.SpecServeError:
            assert mapped is cls


@pytest.mark.system
@module_loop
@pytest.mark.parametrize("cls", errors.all_error_classes()[1:], ids=lambda c: c.__name__)
async def test_a_domain_error_raised_in_the_server_arrives_as_its_sdk_class(fake, cls):
    async with AsyncClient(fake.address, retries=0) as client:
        with pytest.raises(errors.SpecServeError) as info:
            await client.generate(f"raise:{cls.__name__}")
    # The server names the exact class in trailing metadata (specserve.runtime.server.ERROR_CLASS_KEY).
    assert type(info.value) is cls
    assert isinstance(info.value, ERRORS_BY_CODE[grpc.StatusCode[cls.grpc_code_name]])
    assert f"{cls.__name__} because of the script" in str(info.value)
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert info.value.status_code == grpc.StatusCode[cls.grpc_code_name]


@pytest.mark.system
@module_loop
@pytest.mark.parametrize("cls", errors.all_error_classes(), ids=lambda c: c.__name__)
async def test_a_class_named_in_trailing_metadata_is_raised_exactly(fake, cls):
    async with AsyncClient(fake.address, retries=0) as client:
        with pytest.raises(errors.SpecServeError) as info:
            await client.generate(f"named:{cls.__name__}")
    assert type(info.value) is cls
    assert f"{cls.__name__} named by the script" in str(info.value)


@pytest.mark.unit
def test_a_named_class_wider_than_the_code_is_not_trusted():
    class FakeRpcError(grpc.RpcError):
        """A stand-in for a received status: lets the test pair any code with any metadata."""

        def code(self):
            return grpc.StatusCode.ABORTED

        def details(self):
            return "conflict"

        def trailing_metadata(self):
            return ((ERROR_CLASS_KEY, "InvalidArgument"), ("specserve-retry-after-s", "1.5"))

    err = error_from_rpc(FakeRpcError())
    assert type(err) is errors.Aborted
    assert err.retry_after_s == 1.5


# --------------------------------------------------------------------------- request building


@pytest.mark.unit
def test_build_request_maps_every_argument():
    req = build_request(
        "hello",
        params=GenerationParams(
        max_new_tokens=12,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        seed=2**63,
        stop="\n\n",
        stop_token_ids=[3, 4],
        ignore_eos=True,
        gamma=4,
        proposer="ngram",
        draft_top_k=8,
        sampling_mode="coupled",
        min_confidence=0.25,
        ),
    )
    assert req.WhichOneof("prompt") == "text" and req.text == "hello"
    s = req.sampling
    assert (s.top_k, s.seed) == (5, 2**63)
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.05) and s.repetition_penalty == pytest.approx(1.2)
    assert list(req.stop.stop_strings) == ["\n\n"] and list(req.stop.stop_token_ids) == [3, 4]
    assert req.stop.max_new_tokens == 12 and req.stop.ignore_eos
    assert build_request("x", params=GenerationParams(min_new_tokens=6)).stop.min_new_tokens == 6
    assert req.speculation.gamma == 4 and req.speculation.draft_top_k == 8
    assert req.speculation.min_confidence == pytest.approx(0.25)
    assert req.speculation.proposer == common_pb2.PROPOSER_KIND_NGRAM
    assert s.sampling_mode == common_pb2.SAMPLING_MODE_COUPLED
    assert (
        build_request("x", params=GenerationParams(sampling_mode="optimal")).sampling.sampling_mode == common_pb2.SAMPLING_MODE_OPTIMAL
    )


@pytest.mark.unit
def test_build_request_defaults_leave_server_choices_absent():
    req = build_request(prompt_token_ids=[5, 6, 7])
    assert list(req.tokens.token_ids) == [5, 6, 7]
    assert not req.sampling.HasField("seed")
    assert not req.speculation.HasField("gamma") and not req.speculation.HasField("min_confidence")
    assert req.stop.max_new_tokens == 0
    assert req.speculation.proposer == common_pb2.PROPOSER_KIND_UNSPECIFIED  # the server's default
    assert req.sampling.sampling_mode == common_pb2.SAMPLING_MODE_UNSPECIFIED  # the server's default
    assert not build_request("x", params=GenerationParams(gamma="auto")).speculation.HasField("gamma")
    assert build_request("x", params=GenerationParams(gamma=0)).speculation.HasField("gamma")
    assert build_request(prompt_token_ids=[]).WhichOneof("prompt") == "tokens"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"proposer": "oracle"}, r"proposer must be one of \['feature', 'model', 'ngram'\]"),
        ({"sampling_mode": "exact"}, r"sampling_mode must be one of \['coupled', 'optimal'\]"),
        ({"gamma": -1}, "gamma must be"),
        ({"gamma": "many"}, "gamma must be"),
        ({"top_k": -3}, "top_k must be an integer"),
        ({"seed": -1}, "seed must be an integer"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be an integer"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs=True"),
        ({"min_confidence": 1.0}, r"must be in \[0, 1\)"),
    ],
)
def test_bad_settings_raise_invalid_argument_before_any_call(kwargs, needle):
    with pytest.raises(errors.InvalidArgument, match=needle):
        GenerationParams(**kwargs)
    with pytest.raises(errors.InvalidArgument, match=needle), Client("127.0.0.1:1") as client:
        client.stream("text", **kwargs)  # the same check, before any call (nothing listens on port 1)


@pytest.mark.unit
def test_two_prompts_are_refused():
    with pytest.raises(errors.InvalidArgument, match="exactly one of prompt"):
        build_request("text", prompt_token_ids=[1])


@pytest.mark.unit
def test_no_prompt_at_all_is_refused():
    with pytest.raises(errors.InvalidArgument, match="exactly one of prompt"):
        build_request()


@pytest.mark.unit
def test_build_request_carries_chat_messages_in_order():
    req = build_request(
        messages=[{"role": "system", "content": "be brief"}, ("user", "hi")],
        params=GenerationParams(max_new_tokens=3),
    )
    assert req.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert req.stop.max_new_tokens == 3
    assert build_request(messages=[]).WhichOneof("prompt") == "chat"  # the server refuses it


@pytest.mark.unit
@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ("hello", "messages must be a list"),
        ({"role": "user", "content": "hi"}, "messages must be a list"),
        ([{"role": "user"}], "each chat message must be"),
        ([{"role": "user", "content": 3}], "each chat message must be"),
        ([("user",)], "each chat message must be"),
    ],
)
def test_malformed_chat_messages_are_refused_before_any_call(messages, needle):
    with pytest.raises(errors.InvalidArgument, match=needle):
        build_request(messages=messages)
    with pytest.raises(errors.InvalidArgument, match="exactly one of prompt"):
        build_request("text", messages=[{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- results, streams, retries


@pytest.mark.system
@module_loop
async def test_sync_generate_and_stream_agree_and_fill_stats(fake):
    def run():
        with Client(fake.address) as client:
            result = client.generate("ok:5")
            with client.stream("ok:5") as stream:
                with pytest.raises(RuntimeError, match="not finished"):
                    _ = stream.result
                chunks = list(stream)
            return result, chunks, stream.result

    result, chunks, streamed = await asyncio.to_thread(run)
    assert result.token_ids == (10, 11, 12, 13, 14)
    assert result.text == "t10t11t12t13t14"
    assert [c.token_ids for c in chunks] == [(t,) for t in range(10, 15)]
    assert streamed == result
    stats = result.stats
    assert (stats.rounds, stats.proposed_tokens, stats.accepted_tokens) == (2, 8, 6)
    assert stats.accepted_per_position == (2, 2, 1, 1)
    assert stats.acceptance_rate == 0.75
    assert result.finish_reason == "length"
    assert (stats.session_id, stats.seed) == ("s-1", 7)
    assert stats.total_s == 5.0 and stats.tokens_per_s == 1.0 and stats.verify_s == 0.003


@pytest.mark.system
@module_loop
async def test_async_stream_exposes_result_after_exhaustion(fake):
    async with AsyncClient(fake.address) as client:
        stream = client.stream("ok:3")
        got = [chunk.token_ids async for chunk in stream]
        assert got == [(10,), (11,), (12,)]
        assert stream.result.token_ids == (10, 11, 12)
        assert stream.stats.completion_tokens == 3


@pytest.mark.system
@module_loop
async def test_unavailable_before_the_first_token_is_retried(fake):
    async with AsyncClient(fake.address, retries=3, backoff=0.01) as client:
        result = await client.generate("flaky:2:4")
    assert result.token_ids == (10, 11, 12, 13)
    assert sum(1 for t, _ in fake.calls if t == "flaky:2:4") == 3

    def sync_run():
        with Client(fake.address, retries=2, backoff=0.01) as client:
            return client.generate("flaky:2:1")

    assert (await asyncio.to_thread(sync_run)).token_ids == (10,)


@pytest.mark.system
@module_loop
async def test_retries_give_up_with_unavailable(fake):
    async with AsyncClient(fake.address, retries=1, backoff=0.01) as client:
        with pytest.raises(errors.Unavailable, match="not yet"):
            await client.generate("flaky:5:1")
    assert sum(1 for t, _ in fake.calls if t == "flaky:5:1") == 2


@pytest.mark.system
@module_loop
async def test_resource_exhausted_with_a_hint_is_retried_after_the_hint(fake):
    """A session limit or rate (issue 54): the SDK waits the server's hint, then sends again."""
    async with AsyncClient(fake.address, rate_limit_retries=3) as client:
        result = await client.generate("exhausted:2:0.05:3")
    assert result.token_ids == (10, 11, 12)
    arrivals = fake.arrivals["exhausted:2:0.05:3"]
    assert len(arrivals) == 3
    assert all(later - earlier >= 0.05 for earlier, later in itertools.pairwise(arrivals)), "sent again before the hint"

    def sync_run():
        with Client(fake.address, rate_limit_retries=1) as client:
            return client.generate("exhausted:1:0.01:1")

    assert (await asyncio.to_thread(sync_run)).token_ids == (10,)
    assert len(fake.arrivals["exhausted:1:0.01:1"]) == 2


@pytest.mark.system
@module_loop
async def test_resource_exhausted_is_raised_once_the_bounded_retries_are_spent(fake):
    async with AsyncClient(fake.address, rate_limit_retries=2) as client:
        with pytest.raises(errors.ResourceExhausted, match="slow down") as info:
            await client.generate("exhausted:9:0.01:1")
    assert info.value.retry_after_s == 0.01
    assert len(fake.arrivals["exhausted:9:0.01:1"]) == 3
    # Not retried: no hint (a limit that waiting cannot help), a hint past 60 s (the caller's decision).
    async with AsyncClient(fake.address) as client:
        with pytest.raises(errors.ResourceExhausted):
            await client.generate("raise:ResourceExhausted")
        with pytest.raises(errors.ResourceExhausted) as info:
            await client.generate("exhausted:9:61:1")
    assert info.value.retry_after_s == 61
    assert len(fake.arrivals["raise:ResourceExhausted"]) == 1 and len(fake.arrivals["exhausted:9:61:1"]) == 1


@pytest.mark.system
@module_loop
async def test_unavailable_after_a_token_is_never_resent(fake):
    async with AsyncClient(fake.address, retries=3, backoff=0.01) as client:
        stream = client.stream("chunk-then-unavailable")
        seen = []
        with pytest.raises(errors.Unavailable, match="after one chunk"):
            async for chunk in stream:
                seen.append(chunk.token_ids)
    assert seen == [(1,)]
    assert sum(1 for t, _ in fake.calls if t == "chunk-then-unavailable") == 1

    def sync_run():
        with Client(fake.address, retries=3, backoff=0.01) as client:
            client.generate("chunk-then-unavailable")

    with pytest.raises(errors.Unavailable):
        await asyncio.to_thread(sync_run)
    assert sum(1 for t, _ in fake.calls if t == "chunk-then-unavailable") == 2


@pytest.mark.system
def test_dead_port_fails_with_unavailable_naming_the_address():
    from specserve.launch.redis_server import free_port

    address = f"127.0.0.1:{free_port()}"
    with Client(address, retries=2, backoff=0.01) as client:
        with pytest.raises(errors.Unavailable) as info:
            client.generate("hello")
    assert address in str(info.value)
    assert isinstance(info.value, ConnectionError)


@pytest.mark.system
@module_loop
async def test_token_travels_as_bearer_metadata(fake):
    async with AsyncClient(fake.address, token="s3cret") as client:
        await client.generate("ok:1")
    assert fake.calls[-1][1]["authorization"] == "Bearer s3cret"

    def sync_run():
        with Client(fake.address) as client:
            client.generate("ok:1")

    await asyncio.to_thread(sync_run)
    assert "authorization" not in fake.calls[-1][1]


@pytest.mark.system
@module_loop
async def test_leaving_a_stream_early_cancels_it_on_the_server(fake):
    async with AsyncClient(fake.address) as client:
        async with client.stream("hang") as stream:
            async for chunk in stream:
                assert chunk.token_ids == (1,)
                break
        await asyncio.to_thread(fake.cancelled.wait, 10)
    assert fake.cancelled.is_set()


@pytest.mark.system
@module_loop
async def test_sync_cancel_stops_the_server_side(fake):
    def run():
        with Client(fake.address) as client:
            stream = client.stream("hang")
            first = next(stream)
            stream.cancel()
            with pytest.raises(errors.Cancelled):
                next(stream)
            return first

    assert (await asyncio.to_thread(run)).token_ids == (1,)
    await asyncio.to_thread(fake.cancelled.wait, 10)
    assert fake.cancelled.is_set()


@pytest.mark.system
@module_loop
async def test_mutual_tls(tmp_path):
    """The SDK speaks TLS with the CA and client certificate given as files; without them it cannot."""
    from certs import make_pki

    pki = make_pki(tmp_path)
    settings = CommonSettings(
        host="127.0.0.1",
        port=0,
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_ca_file=pki.ca,
    )
    servicer = ScriptedCoordinator()
    running = await create_server(
        settings,
        [
            Registration(
                coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                servicer,
                "specserve.v1.CoordinatorService",
            )
        ],
    )
    address = f"127.0.0.1:{running.port}"
    try:
        kw = {
            "root_certificates": pki.ca,
            "private_key": pki.client.key,
            "certificate_chain": pki.client.cert,
        }
        async with AsyncClient(address, **kw) as client:
            assert (await client.generate("ok:2")).token_ids == (10, 11)
        async with AsyncClient(address, root_certificates=pki.ca.read_bytes(), retries=0) as client:
            with pytest.raises(errors.Unavailable):
                await client.generate("ok:2")
        async with AsyncClient(address, retries=0) as client:  # plaintext to a TLS port
            with pytest.raises(errors.Unavailable):
                await client.generate("ok:2")
    finally:
        await running.stop(0)
    assert len(servicer.calls) == 1


# --------------------------------------------------------------------------- part 2: the real system

PROMPT = "def add(a, b):\n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory):
    import system_fixtures as sf

    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(pair, redis_server):
    import system_fixtures as sf

    async with sf.local_stack(pair, redis_server.url) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def session_store(redis_server):
    from specserve.runtime.store import SessionStore

    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()


async def logged_completion(store, session_id: str) -> tuple[int, ...]:
    record = await store.load(session_id)
    return tuple(record.generated_token_ids)


def check_stats(result) -> None:
    s = result.stats
    assert s.session_id
    assert s.completion_tokens == len(result.token_ids) > 0
    assert s.prompt_tokens > 0
    assert s.rounds >= 1
    assert 0 <= s.accepted_tokens <= s.proposed_tokens
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert 0 < s.first_token_ns <= s.total_ns
    assert s.verify_ns > 0
    assert result.finish_reason in ("length", "eos")


@module_loop
@pytest.mark.parametrize("gamma", [2, "auto"])
async def test_generate_and_stream_agree_with_each_other_and_the_redis_log(stack, session_store, gamma):
    kw = {"max_new_tokens": 12, "temperature": 0, "gamma": gamma}

    def sync_generate():
        with Client(stack.address) as client:
            return client.generate(PROMPT, **kw)

    generated = await asyncio.to_thread(sync_generate)
    async with AsyncClient(stack.address) as client:
        async with client.stream(PROMPT, **kw) as stream:
            chunks = [chunk async for chunk in stream]
        streamed = stream.result
        again = await client.generate(PROMPT, **kw)

    assert generated.token_ids == streamed.token_ids == again.token_ids
    assert generated.text == streamed.text == "".join(c.text for c in chunks)
    assert tuple(t for c in chunks for t in c.token_ids) == streamed.token_ids
    for result in (generated, streamed, again):
        check_stats(result)
        assert await logged_completion(session_store, result.stats.session_id) == result.token_ids
    assert len({generated.stats.session_id, streamed.stats.session_id, again.stats.session_id}) == 3


@module_loop
async def test_token_ids_prompt_ngram_proposer_and_seed_echo(stack, session_store, pair):
    tokenizer = pair.tokenizer
    ids = tokenizer("for i in range(10):\n", add_special_tokens=False)["input_ids"]
    async with AsyncClient(stack.address) as client:
        by_ids = await client.generate(prompt_token_ids=ids, max_new_tokens=10, temperature=0, gamma=3)
        ngram = await client.generate(
            prompt_token_ids=ids, max_new_tokens=10, temperature=0, gamma=3, proposer="ngram"
        )
        sampled = await client.generate(prompt_token_ids=ids, max_new_tokens=6, seed=1234, top_k=50)
    assert by_ids.token_ids == ngram.token_ids  # greedy output does not depend on the proposer
    assert by_ids.stats.prompt_tokens == len(ids)
    assert sampled.stats.seed == 1234
    for result in (by_ids, ngram, sampled):
        assert await logged_completion(session_store, result.stats.session_id) == result.token_ids


def _wire(prompt: str, **sampling: float) -> coordinator_pb2.GenerateRequest:
    """A request as another client might send it: the SDK's own checks do not stand in the way."""
    request = build_request(prompt)
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


@module_loop
@pytest.mark.parametrize(
    ("request_pb", "needle"),
    [
        (build_request(""), "prompt is empty"),
        (build_request(prompt_token_ids=[]), "prompt is empty"),
        (_wire("x", temperature=-1.0), "temperature must be >= 0"),
        (_wire("x", top_p=0.0), "top_p must be in (0, 1]"),
        (_wire("x", top_p=1.5), "top_p must be in (0, 1]"),
        (build_request("x", params=GenerationParams(max_new_tokens=100_000)), "above this server's limit"),
    ],
)
async def test_bad_requests_raise_invalid_argument_saying_what_to_fix(stack, request_pb, needle):
    from specserve.client import AsyncTokenStream

    async with AsyncClient(stack.address) as client:
        good = asyncio.ensure_future(client.generate(PROMPT, max_new_tokens=6, temperature=0))
        with pytest.raises(errors.InvalidArgument) as info:
            async with AsyncTokenStream(client, request_pb) as stream:
                async for _ in stream:
                    pass
        assert needle in info.value.message
        assert info.value.status_code == grpc.StatusCode.INVALID_ARGUMENT
        # The server keeps serving: a concurrent request and a later one both finish.
        assert len((await good).token_ids) == 6
        assert len((await client.generate(PROMPT, max_new_tokens=4, temperature=0)).token_ids) == 4


@module_loop
async def test_unknown_proposer_is_refused_by_the_sdk_and_by_the_server(stack):
    async with AsyncClient(stack.address) as client:
        with pytest.raises(errors.InvalidArgument, match=r"proposer must be one of \['feature', 'model', 'ngram'\]"):
            await client.generate(PROMPT, proposer="oracle")
        # A proposer value the SDK cannot even name (as another client might send) reaches the server.
        from specserve.client import AsyncTokenStream

        request = build_request(PROMPT, params=GenerationParams(max_new_tokens=4))
        request.speculation.proposer = 7
        with pytest.raises(errors.InvalidArgument, match="proposer"):
            async with AsyncTokenStream(client, request) as stream:
                async for _ in stream:
                    pass
        assert len((await client.generate(PROMPT, max_new_tokens=3, temperature=0)).token_ids) == 3


CONVERSATION = [
    {"role": "system", "content": "you write python"},
    {"role": "user", "content": "def add(a, b):"},
]


@module_loop
async def test_chat_is_the_greedy_continuation_of_the_rendered_chat_template(stack, pair, session_store):
    import system_fixtures as sf

    tokenizer = pair.tokenizer
    prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)["input_ids"]
    kw = {"max_new_tokens": 10, "temperature": 0, "gamma": 2, "ignore_eos": True}

    def sync_chat():
        with Client(stack.address) as client:
            with client.stream_chat(CONVERSATION, **kw) as stream:
                chunks = list(stream)
            return client.chat(CONVERSATION, **kw), stream.result, chunks

    chat, streamed, chunks = await asyncio.to_thread(sync_chat)
    async with AsyncClient(stack.address) as client:
        async_chat = await client.chat(CONVERSATION, **kw)
        async with client.stream_chat(CONVERSATION, **kw) as stream:
            async_chunks = [c async for c in stream]
    want = tuple(sf.reference_greedy(pair.target_dir, prompt, 10, ignore_eos=True))
    for result in (chat, streamed, async_chat, stream.result):
        assert result.token_ids == want
        assert result.stats.prompt_tokens == len(prompt)
        assert result.text == tokenizer.decode(list(want), skip_special_tokens=True)
        assert await logged_completion(session_store, result.stats.session_id) == want
    assert "".join(c.text for c in chunks) == "".join(c.text for c in async_chunks) == chat.text


@module_loop
async def test_chat_with_a_model_without_a_chat_template_is_a_failed_precondition(stack, pair):
    """A second coordinator on the same workers whose tokenizer has no chat template."""
    from specserve.coordinator.server import start_coordinator
    from specserve.runtime.config import CoordinatorSettings

    plain = pair.tokenizer
    plain.chat_template = None
    settings = CoordinatorSettings(
        host="127.0.0.1",
        port=0,
        redis_url=stack.coordinator.settings.redis_url,
        target_endpoints=stack.coordinator.settings.target_endpoints,
        draft_endpoints=stack.coordinator.settings.draft_endpoints,
    )
    app = await start_coordinator(settings, tokenizer=plain)
    try:
        async with AsyncClient(f"127.0.0.1:{app.port}") as client:
            with pytest.raises(errors.FailedPrecondition, match="no chat template") as info:
                await client.chat(CONVERSATION, max_new_tokens=4)
            assert info.value.status_code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(errors.InvalidArgument, match="conversation is empty"):
                await client.chat([], max_new_tokens=4)
            # Text prompts still work there.
            assert len((await client.generate(PROMPT, max_new_tokens=3, temperature=0)).token_ids) == 3
    finally:
        await app.stop(0.5)


@module_loop
async def test_client_retries_until_the_coordinator_comes_up(pair, redis_server, monkeypatch):
    """The client starts first; the stack is started only after the client's first failed attempt."""
    import types

    import system_fixtures as sf

    import specserve.client._client as client_module
    from specserve.launch.redis_server import free_port

    retrying = threading.Event()
    slept: list[float] = []

    def recording_sleep(seconds: float) -> None:
        slept.append(seconds)
        retrying.set()
        threading.Event().wait(seconds)

    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(sleep=recording_sleep))
    port = free_port()

    def run():
        with Client(f"127.0.0.1:{port}", retries=30, backoff=0.25, max_backoff=1.0) as client:
            return client.generate(PROMPT, max_new_tokens=5, temperature=0)

    future = asyncio.ensure_future(asyncio.to_thread(run))
    assert await asyncio.to_thread(retrying.wait, 30), "the client never retried"
    async with sf.local_stack(pair, redis_server.url, port=port):
        result = await asyncio.wait_for(future, 60)
    assert len(result.token_ids) == 5
    assert len(slept) >= 1


@module_loop
async def test_the_module_docstring_examples_run(stack, capsys):
    """The examples users copy from ``specserve.client`` work as written (address aside)."""
    import textwrap

    import specserve.client

    blocks = [b.split("\n\n")[0] for b in specserve.client.__doc__.split("::\n\n")[1:3]]
    sync_code, async_code = (textwrap.dedent(b).replace("127.0.0.1:50051", stack.address) for b in blocks)
    await asyncio.to_thread(exec, sync_code, {})
    namespace = {"AsyncClient": AsyncClient}
    exec("async def example():\n" + textwrap.indent(async_code, "    "), namespace)
    await namespace["example"]()
    out = capsys.readouterr().out
    assert out.strip()
