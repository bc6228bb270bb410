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
import threading

import grpc
import pytest

from specserve import AsyncClient, Client, errors
from specserve.client import ERROR_CLASS_KEY, ERRORS_BY_CODE, build_request, error_from_rpc
from specserve.config import CommonSettings
from specserve.server import Registration, create_server
from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

# --------------------------------------------------------------------------- the fake coordinator


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """A fake coordinator: the prompt text says what to do.

    * ``ok:<n>``: stream tokens 10..10+n one per chunk (text ``t<id>``), then stats.
    * ``raise:<Class>``: raise that domain error (the server interceptor maps it).
    * ``named:<Class>``: abort with the class's code and name it in trailing metadata.
    * ``flaky:<k>:<n>``: UNAVAILABLE for the first k calls with this text, then ``ok:<n>``.
    * ``chunk-then-unavailable``: one chunk, then UNAVAILABLE.
    * ``hang``: one chunk, then wait until cancelled.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        text = request.text
        self.calls.append((text, dict(context.invocation_metadata())))
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


@pytest.fixture
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


def test_every_status_code_but_ok_maps_to_an_sdk_error():
    codes = set(grpc.StatusCode) - {grpc.StatusCode.OK}
    assert set(ERRORS_BY_CODE) == codes
    for code, cls in ERRORS_BY_CODE.items():
        assert issubclass(cls, errors.SpecServeError), code


def test_every_error_class_is_reachable_from_its_code():
    """The code alone yields the class or its base; the class name in metadata yields the class."""
    for cls in errors.all_error_classes():
        mapped = ERRORS_BY_CODE[grpc.StatusCode[cls.grpc_code_name]]
        assert issubclass(cls, mapped), (cls, mapped)
        # Classes that own a code (not a refinement of one) are what the code gives back.
        if cls.__base__ is errors.SpecServeError:
            assert mapped is cls


@pytest.mark.parametrize("cls", errors.all_error_classes()[1:], ids=lambda c: c.__name__)
async def test_a_domain_error_raised_in_the_server_arrives_as_its_sdk_class(fake, cls):
    async with AsyncClient(fake.address, retries=0) as client:
        with pytest.raises(errors.SpecServeError) as info:
            await client.generate(f"raise:{cls.__name__}")
    expected = ERRORS_BY_CODE[grpc.StatusCode[cls.grpc_code_name]]
    assert type(info.value) is expected
    assert f"{cls.__name__} because of the script" in str(info.value)
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert info.value.status_code == grpc.StatusCode[cls.grpc_code_name]


@pytest.mark.parametrize("cls", errors.all_error_classes(), ids=lambda c: c.__name__)
async def test_a_class_named_in_trailing_metadata_is_raised_exactly(fake, cls):
    async with AsyncClient(fake.address, retries=0) as client:
        with pytest.raises(errors.SpecServeError) as info:
            await client.generate(f"named:{cls.__name__}")
    assert type(info.value) is cls
    assert f"{cls.__name__} named by the script" in str(info.value)


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


def test_build_request_maps_every_argument():
    req = build_request(
        "hello",
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
    )
    assert req.WhichOneof("prompt") == "text" and req.text == "hello"
    s = req.sampling
    assert (s.top_k, s.seed) == (5, 2**63)
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.05) and s.repetition_penalty == pytest.approx(1.2)
    assert list(req.stop.stop_strings) == ["\n\n"] and list(req.stop.stop_token_ids) == [3, 4]
    assert req.stop.max_new_tokens == 12 and req.stop.ignore_eos
    assert req.speculation.gamma == 4 and req.speculation.draft_top_k == 8
    assert req.speculation.proposer == common_pb2.PROPOSER_KIND_NGRAM


def test_build_request_defaults_leave_server_choices_absent():
    req = build_request(prompt_token_ids=[5, 6, 7])
    assert list(req.tokens.token_ids) == [5, 6, 7]
    assert not req.sampling.HasField("seed")
    assert not req.speculation.HasField("gamma")
    assert req.stop.max_new_tokens == 0
    assert req.speculation.proposer == common_pb2.PROPOSER_KIND_MODEL
    assert not build_request("x", gamma="auto").speculation.HasField("gamma")
    assert build_request("x", gamma=0).speculation.HasField("gamma")
    assert build_request(prompt_token_ids=[]).WhichOneof("prompt") == "tokens"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"proposer": "oracle"}, "proposer must be 'model' or 'ngram'"),
        ({"gamma": -1}, "gamma must be"),
        ({"gamma": "many"}, "gamma must be"),
        ({"top_k": -3}, "top_k must be an integer"),
        ({"seed": -1}, "seed must be an integer"),
        ({"stop_token_ids": [-1]}, "token ids"),
        ({"prompt_token_ids": [1]}, "exactly one of prompt"),
    ],
)
def test_unencodable_arguments_raise_invalid_argument_before_any_call(kwargs, needle):
    with pytest.raises(errors.InvalidArgument, match=needle):
        build_request("text", **kwargs)


def test_no_prompt_at_all_is_refused():
    with pytest.raises(errors.InvalidArgument, match="exactly one of prompt"):
        build_request()


# --------------------------------------------------------------------------- results, streams, retries


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


async def test_async_stream_exposes_result_after_exhaustion(fake):
    async with AsyncClient(fake.address) as client:
        stream = client.stream("ok:3")
        got = [chunk.token_ids async for chunk in stream]
        assert got == [(10,), (11,), (12,)]
        assert stream.result.token_ids == (10, 11, 12)
        assert stream.stats.completion_tokens == 3


async def test_unavailable_before_the_first_token_is_retried(fake):
    async with AsyncClient(fake.address, retries=3, backoff=0.01) as client:
        result = await client.generate("flaky:2:4")
    assert result.token_ids == (10, 11, 12, 13)
    assert sum(1 for t, _ in fake.calls if t == "flaky:2:4") == 3

    def sync_run():
        with Client(fake.address, retries=2, backoff=0.01) as client:
            return client.generate("flaky:2:1")

    assert (await asyncio.to_thread(sync_run)).token_ids == (10,)


async def test_retries_give_up_with_unavailable(fake):
    async with AsyncClient(fake.address, retries=1, backoff=0.01) as client:
        with pytest.raises(errors.Unavailable, match="not yet"):
            await client.generate("flaky:5:1")
    assert sum(1 for t, _ in fake.calls if t == "flaky:5:1") == 2


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


def test_dead_port_fails_with_unavailable_naming_the_address():
    from redis_server import free_port

    address = f"127.0.0.1:{free_port()}"
    with Client(address, retries=2, backoff=0.01) as client:
        with pytest.raises(errors.Unavailable) as info:
            client.generate("hello")
    assert address in str(info.value)
    assert isinstance(info.value, ConnectionError)


async def test_token_travels_as_bearer_metadata(fake):
    async with AsyncClient(fake.address, token="s3cret") as client:
        await client.generate("ok:1")
    assert fake.calls[-1][1]["authorization"] == "Bearer s3cret"

    def sync_run():
        with Client(fake.address) as client:
            client.generate("ok:1")

    await asyncio.to_thread(sync_run)
    assert "authorization" not in fake.calls[-1][1]


async def test_leaving_a_stream_early_cancels_it_on_the_server(fake):
    async with AsyncClient(fake.address) as client:
        async with client.stream("hang") as stream:
            async for chunk in stream:
                assert chunk.token_ids == (1,)
                break
        await asyncio.to_thread(fake.cancelled.wait, 10)
    assert fake.cancelled.is_set()


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
