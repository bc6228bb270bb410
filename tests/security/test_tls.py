"""TLS on every hop: clients -> coordinator (TLS), coordinator -> workers (mutual TLS).

One stack: the target and the draft present the test CA's server certificate
and require client certificates from that CA (``tls_ca_file``) naming the
coordinator (``tls_client_names``: a certificate from the same CA with another
name is PERMISSION_DENIED); the coordinator
presents the same server certificate to clients and its client certificate to
the workers (``worker_tls_*``). Certificates come from ``tests/certs.py``.
"""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
import system_fixtures as sf
from security_helpers import running_roles

from specserve.api import errors
from specserve.client import AsyncClient
from specserve.coordinator.fleet.clients import DraftClient, TargetClient
from specserve.runtime.config import CoordinatorSettings
from specserve.v1 import coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 6, 7, 8]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(sec_pair, sec_models, redis_server, pki):
    worker = {
        "tls_cert_file": pki.server.cert,
        "tls_key_file": pki.server.key,
        "tls_ca_file": pki.ca,
        "tls_client_names": ["coordinator"],
    }
    coordinator = {
        "tls_cert_file": pki.server.cert,
        "tls_key_file": pki.server.key,
        "worker_tls_ca_file": pki.ca,
        "worker_tls_cert_file": pki.client.cert,
        "worker_tls_key_file": pki.client.key,
    }
    async with running_roles(
        sec_pair, sec_models, redis_server.url, worker=worker, coordinator=coordinator
    ) as r:
        yield r


async def test_a_tls_client_generates_end_to_end_through_mutual_tls_workers(roles, pki):
    async with AsyncClient(roles.address, root_certificates=pki.ca, retries=0) as client:
        result = await client.generate(
            prompt_token_ids=PROMPT, max_new_tokens=8, temperature=0, gamma=2, ignore_eos=True
        )
    assert len(result.token_ids) == 8
    # The draft was reached over mutual TLS (a draft fault would fall back to gamma = 0 silently).
    assert result.stats.proposed_tokens > 0
    assert list(result.token_ids) == sf.reference_greedy(
        roles.target.settings.model, PROMPT, 8, ignore_eos=True
    )


async def test_a_plaintext_client_cannot_reach_a_tls_coordinator(roles):
    async with grpc.aio.insecure_channel(roles.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(sf.request(PROMPT, max_new_tokens=2), timeout=5):
                pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def _channel(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    address = f"127.0.0.1:{port}"
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, credentials)


@pytest.mark.parametrize("worker", ["draft", "target"])
async def test_worker_calls_need_a_client_certificate_from_the_ca(roles, pki, worker):
    port = roles.draft.port if worker == "draft" else roles.target.port
    ca = pki.ca.read_bytes()

    async def call(credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
        async with _channel(port, credentials) as channel:
            try:
                if worker == "draft":
                    await draft_pb2_grpc.DraftServiceStub(channel).Propose(
                        draft_pb2.ProposeRequest(), timeout=5
                    )
                else:
                    await target_pb2_grpc.TargetServiceStub(channel).Verify(
                        target_pb2.VerifyRequest(), timeout=5
                    )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert await call(None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert (
        await call(grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE
    )  # no client certificate
    rogue = grpc.ssl_channel_credentials(
        ca, pki.rogue_client.key.read_bytes(), pki.rogue_client.cert.read_bytes()
    )
    assert await call(rogue) == grpc.StatusCode.UNAVAILABLE  # a certificate from another CA
    intruder = grpc.ssl_channel_credentials(
        ca, pki.other_client.key.read_bytes(), pki.other_client.cert.read_bytes()
    )
    assert await call(intruder) == grpc.StatusCode.PERMISSION_DENIED  # the CA's, but not the coordinator's
    # Control: the coordinator's certificate reaches the servicer, which refuses the empty request itself.
    good = grpc.ssl_channel_credentials(ca, pki.client.key.read_bytes(), pki.client.cert.read_bytes())
    assert await call(good) == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_coordinators_worker_clients_without_a_certificate_are_refused(roles, pki):
    """The coordinator's own clients: with only the CA (no client certificate) the workers refuse them."""
    no_cert = CoordinatorSettings(host="127.0.0.1", worker_tls_ca_file=pki.ca, rpc_timeout_s=5.0)
    with_cert = CoordinatorSettings(
        host="127.0.0.1",
        worker_tls_ca_file=pki.ca, worker_tls_cert_file=pki.client.cert, worker_tls_key_file=pki.client.key
    )
    for cls, port in ((DraftClient, roles.draft.port), (TargetClient, roles.target.port)):
        endpoint = f"127.0.0.1:{port}"
        refused = cls(endpoint, no_cert)
        try:
            with pytest.raises(errors.Unavailable):
                await refused.info(timeout_s=5)
        finally:
            await refused.close()
        admitted = cls(endpoint, with_cert)
        try:
            info = await admitted.info(timeout_s=5)
            assert info.model.vocab_size == roles.target.model.vocab_size
        finally:
            await admitted.close()


async def test_clients_with_different_certificates_are_different_prefix_cache_tenants(roles, pki):
    """Issue 54: under mutual TLS without tokens the tenant is the client certificate's names: a client with
    another certificate of the same CA finds nothing of the first's prompt in the cache, the same one does."""
    from specserve.coordinator.server import start_coordinator

    settings = roles.coordinator.settings.model_copy(update={"port": 0, "tls_ca_file": pki.ca})
    app = await start_coordinator(settings)
    prompt = list(range(5, 45))  # 40 tokens: 2 whole blocks of 16 to attach
    want = sf.reference_greedy(roles.target.settings.model, prompt, 4, ignore_eos=True)

    async def cached(client_pair) -> int:
        async with AsyncClient(
            f"localhost:{app.port}",
            root_certificates=pki.ca,
            private_key=client_pair.key,
            certificate_chain=client_pair.cert,
            retries=0,
        ) as client:
            result = await client.generate(
                prompt_token_ids=prompt, max_new_tokens=4, temperature=0, gamma=2, ignore_eos=True
            )
        assert list(result.token_ids) == want
        return result.stats.cached_tokens

    try:
        assert await cached(pki.client) == 0
        assert await cached(pki.other_client) == 0  # another certificate: another tenant
        assert await cached(pki.client) == 32
        assert await cached(pki.other_client) == 32
    finally:
        await app.stop(0.5)
