"""Workers trust no one by default: they authenticate their callers, and refuse to listen beyond loopback
without a way to.

One stack whose draft and target require the shared worker token (``worker_token``) and whose coordinator
sends it. A direct call without the token, or with another, is refused before it reaches the servicer
(UNAUTHENTICATED / PERMISSION_DENIED): it cannot commit tokens into a live session nor drop its caches.
Health checks stay open for probes. (Mutual TLS pinned to the coordinator's certificate name is in
test_tls.py.) A worker configured to listen on a non-loopback address with neither the token nor pinned
client certificates refuses to start unless ``--insecure`` says so, and ``specserve up``'s stack keeps its
workers on loopback whatever ``--host`` says.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr, ValidationError
from security_helpers import running_roles

from specserve.api import errors
from specserve.api.params import SamplingParams, StopConditions
from specserve.coordinator.fleet.clients import DraftClient, TargetClient
from specserve.runtime.config import CoordinatorSettings, TargetSettings
from specserve.runtime.store import SessionStore
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

WORKER_TOKEN = f"wt-{uuid.uuid4().hex}"
PROMPT = (5, 6, 7, 8)
REPO = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(sec_pair, sec_models, redis_server):
    token = {"worker_token": SecretStr(WORKER_TOKEN)}
    async with running_roles(sec_pair, sec_models, redis_server.url, worker=token, coordinator=token) as r:
        yield r


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(redis_server):
    s = SessionStore.from_url(redis_server.url)
    yield s
    await s.close()


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_the_coordinator_with_the_token_generates_through_both_workers(roles):
    out = await sf.generate(roles.address, sf.request(list(PROMPT), max_new_tokens=8, gamma=2, ignore_eos=True))
    assert len(out.token_ids) == 8
    assert out.stats.proposed_tokens > 0  # the draft answered (a refused Propose would run at gamma 0)
    assert out.token_ids == sf.reference_greedy(roles.target.settings.model, PROMPT, 8, ignore_eos=True)


async def test_a_direct_verify_without_the_token_commits_nothing_into_a_live_session(roles, store):
    """The attack of the review: a Verify with a near-zero draft probability on each token, aimed at a live
    sampled session, would commit attacker-chosen tokens. Without the token it never reaches the verifier."""
    sid = f"victim-{uuid.uuid4().hex}"
    await store.create(sid, PROMPT, SamplingParams(temperature=1.0, seed=1), StopConditions(max_new_tokens=64))
    dists = [common_pb2.DraftDistribution(sparse=common_pb2.SparseDistribution(token_ids=[0, 9], probs=[1 - 1e-9, 1e-9]))]
    attack = target_pb2.VerifyRequest(
        items=[
            target_pb2.VerifyItem(
                base=common_pb2.SessionBase(session_id=sid, committed_len=len(PROMPT), version=0),
                proposal=common_pb2.Proposal(token_ids=[9], distributions=dists),
            )
        ]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{roles.target.port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert await _code(stub.Verify(attack, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(stub.Verify(attack, timeout=10, metadata=_auth("guess"))) == grpc.StatusCode.PERMISSION_DENIED
        release = target_pb2.ReleaseTargetSessionRequest(session_id=sid)
        assert await _code(stub.ReleaseTargetSession(release, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(stub.GetTargetInfo(target_pb2.GetTargetInfoRequest(), timeout=10)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        record = await store.load(sid)
        assert record.token_ids == PROMPT and record.version == 0
        # Control: with the token the same call reaches the verifier (and commits).
        reply = await stub.Verify(attack, timeout=10, metadata=_auth(WORKER_TOKEN))
        assert reply.results[0].WhichOneof("outcome") == "verdict"
        # Probes stay open.
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_direct_propose_or_release_without_the_token_is_refused(roles):
    request = draft_pb2.ProposeRequest(
        base=common_pb2.SessionBase(session_id="someone-else", committed_len=len(PROMPT)),
        token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0),
        gamma=2,
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{roles.draft.port}") as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        assert await _code(stub.Propose(request, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(stub.Propose(request, timeout=10, metadata=_auth("guess"))) == grpc.StatusCode.PERMISSION_DENIED
        release = draft_pb2.ReleaseDraftSessionRequest(session_id="someone-else")
        assert await _code(stub.ReleaseDraftSession(release, timeout=10, metadata=_auth("x"))) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert await _code(stub.Propose(request, timeout=10, metadata=_auth(WORKER_TOKEN))) == grpc.StatusCode.OK


async def test_the_coordinators_clients_with_another_token_are_refused(roles):
    wrong = CoordinatorSettings(host="127.0.0.1", worker_token=SecretStr("not-it"), rpc_timeout_s=5.0)
    for cls, port in ((DraftClient, roles.draft.port), (TargetClient, roles.target.port)):
        client = cls(f"127.0.0.1:{port}", wrong)
        try:
            with pytest.raises(errors.PermissionDenied):
                await client.info(timeout_s=5)
        finally:
            await client.close()


# --------------------------------------------------------------------------- where workers listen


async def test_a_worker_beyond_loopback_without_caller_authentication_refuses_to_start():
    for host in ("0.0.0.0", "::", "10.1.2.3", "target-0.target-headless"):
        with pytest.raises(ValidationError, match="without authenticating its callers"):
            TargetSettings(host=host)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert TargetSettings(host=host).host == host
    assert TargetSettings(host="0.0.0.0", worker_token=SecretStr("t")).authenticates_callers
    assert not TargetSettings(host="0.0.0.0", insecure=True).authenticates_callers
    with pytest.raises(ValidationError, match="needs tls_ca_file"):
        TargetSettings(host="0.0.0.0", tls_client_names=["coordinator"])


async def test_specserve_serve_refuses_a_public_worker_without_auth_unless_insecure(sec_pair):
    """The command line exits with status 2 and says what to do; with --insecure it gets past the check
    (and then fails on the port given, proving it tried to start)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "specserve.launch.cli", "serve", "target", "--host", "0.0.0.0", "--no-warmup"]
    refused = subprocess.run(
        [*base, "--model", str(sec_pair.target_dir)], capture_output=True, text=True, env=env, timeout=120
    )
    assert refused.returncode == 2
    assert "worker_token" in refused.stderr and "--insecure" in refused.stderr
    insecure = subprocess.run(
        [*base, "--insecure", "--port", "70000"], capture_output=True, text=True, env=env, timeout=120
    )
    assert insecure.returncode == 2 and "port" in insecure.stderr and "worker_token" not in insecure.stderr


def _non_loopback_address() -> str | None:
    """An address of this machine beyond loopback, if it has one."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        address = info[4][0]
        if not address.startswith("127."):
            return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outbound interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_the_local_stack_keeps_its_workers_on_loopback_whatever_host_says(sec_pair, redis_server):
    insecure = {"insecure": True}  # the coordinator beyond loopback without client auth: test_coordinator_security.py
    async with sf.local_stack(sec_pair, redis_server.url, host="0.0.0.0", coordinator_overrides=insecure) as stack:
        assert [t.settings.host for t in stack.targets] == ["127.0.0.1"]
        assert stack.draft.settings.host == "127.0.0.1"
        assert stack.coordinator.settings.host == "0.0.0.0"
        address = _non_loopback_address()
        if address is not None:  # from beyond loopback the coordinator answers and the workers do not
            with socket.create_connection((address, stack.port), timeout=5):
                pass
            for port in (*stack.target_ports, stack.draft_port):
                with pytest.raises(OSError):
                    socket.create_connection((address, port), timeout=5).close()
        out = await sf.generate(f"127.0.0.1:{stack.port}", sf.request(list(PROMPT), max_new_tokens=4, gamma=2))
        assert len(out.token_ids) == 4 and out.stats.proposed_tokens > 0


async def test_the_workers_of_a_process_stack_refuse_a_local_caller_without_its_random_token(sec_pair, redis_server):
    """``specserve up`` and ``demo`` run ``start_process_stack``: its workers listen on loopback, where any
    local process reaches them, so they require a worker token made for the stack. A direct Verify or
    Propose is refused; the stack's own coordinator (which has the token) generates through both."""
    from specserve.launch.local import start_process_stack

    stack = await start_process_stack(
        target_model=sec_pair.target_dir, draft_model=sec_pair.draft_dir, redis_url=redis_server.url,
        device="cpu", dtype="float32", target_overrides={"measure_verify_cost": False, "warmup": False},
        draft_overrides={"warmup": False},
    )  # fmt: skip
    try:
        verify = target_pb2.VerifyRequest(
            items=[
                target_pb2.VerifyItem(
                    base=common_pb2.SessionBase(session_id="x", committed_len=len(PROMPT), version=0),
                    proposal=common_pb2.Proposal(token_ids=[9]),
                )
            ]
        )
        propose = draft_pb2.ProposeRequest(
            base=common_pb2.SessionBase(session_id="x", committed_len=len(PROMPT)),
            token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(temperature=0),
            gamma=2,
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.target_ports[0]}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            assert await _code(stub.Verify(verify, timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
            assert await _code(stub.Verify(verify, timeout=30, metadata=_auth("guess"))) == (
                grpc.StatusCode.PERMISSION_DENIED
            )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft_port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            assert await _code(stub.Propose(propose, timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
        out = await sf.generate(stack.address, sf.request(list(PROMPT), max_new_tokens=6, gamma=2, ignore_eos=True))
        assert len(out.token_ids) == 6 and out.stats.proposed_tokens > 0
    finally:
        await stack.stop()
