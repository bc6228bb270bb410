"""Per-client limits that fit a deployment, charged before any work (issue 54, findings 2 and 7).

One target and draft on loopback. The module's coordinator (gRPC and HTTP) accepts four bearer tokens and
lets each client start :data:`BURST` sessions at once, then one every 5 s; the tests that need other
settings start a coordinator of their own on the same workers (``security_helpers.extra_coordinator``):
the defaults without authentication, keying by address (with and without a trusted proxy), mutual TLS.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid

import grpc
import httpx
import pytest
import pytest_asyncio
import system_fixtures as sf
from prometheus_client import REGISTRY
from pydantic import SecretStr
from security_helpers import extra_coordinator, running_roles

from specserve.api import errors
from specserve.api.status import RETRY_AFTER_KEY
from specserve.client import AsyncClient
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

TOKENS = {name: f"tok-{name}-{uuid.uuid4().hex}" for name in ("a", "b", "c", "d")}
PROMPT = [5, 6, 7, 8]
RATE = 0.2  # new sessions per second per client, after the burst: the next one 5 s after the burst
BURST = 2
ONE_TOKEN = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(sec_pair, sec_models, redis_server):
    coordinator = {
        "http_port": 0,
        "auth_tokens": [SecretStr(t) for t in TOKENS.values()],
        "session_rate_per_client": RATE,
        "session_burst_per_client": BURST,
    }
    async with running_roles(sec_pair, sec_models, redis_server.url, coordinator=coordinator) as r:
        yield r


def _exhausted() -> float:
    return REGISTRY.get_sample_value("specserve_coordinator_requests_total", {"status": "resource_exhausted"}) or 0.0


def _compiles() -> float:
    """Constraints the coordinator compiled or looked up, whatever the outcome."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "specserve_coordinator_constraint_compiles"
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def _constrained(regex: str):
    req = sf.request("the answer is", max_new_tokens=2, gamma=0)
    req.sampling.constraint.CopyFrom(common_pb2.Constraint(regex=regex))
    return req


async def _spend_burst(url: str, token: str) -> float:
    """Start ``BURST`` sessions of ``token``'s client in one request (n); returns when it was sent."""
    sent = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as http:
        ok = await http.post(f"{url}/completions", json={**ONE_TOKEN, "n": BURST}, headers=_auth(token))
    assert ok.status_code == 200, ok.text
    return sent


async def test_a_request_refused_by_the_rate_limit_does_no_work(roles):
    """Finding 2: over gRPC a request was parsed and its constraint compiled before admission looked at it.
    Now the rate token is taken first: a refused request compiles nothing (the compile counter stays), over
    gRPC and HTTP; the same request from a client within its rate compiles."""
    url = roles.coordinator.http.url
    await _spend_burst(url, TOKENS["a"])
    before = _compiles()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sf.generate(roles.address, _constrained(f"[a-z]+ {uuid.uuid4().hex}"), metadata=_auth(TOKENS["a"]).items())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    schema = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "integer"}}}
    body = {**ONE_TOKEN, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    async with httpx.AsyncClient(timeout=60) as http:
        refused = await http.post(f"{url}/completions", json=body, headers=_auth(TOKENS["a"]))
    assert refused.status_code == 429, refused.text
    assert _compiles() == before, "a refused request compiled its constraint"
    assert roles.coordinator.coordinator.active_sessions == 0, "a refused request holds no place"
    # Control: the counter sees a compile where one happens.
    out = await sf.generate(roles.address, _constrained(f"[a-z]+ {uuid.uuid4().hex}"), metadata=_auth(TOKENS["c"]).items())
    assert out.stats is not None and _compiles() > before


async def test_an_authenticated_client_over_its_rate_is_told_the_buckets_real_wait(roles):
    """Finding 7: the hint is the token bucket's wait for the next session (5 s after the burst, less the
    time since it was spent), never 0: HTTP 429 with Retry-After in whole seconds and retry-after-ms,
    gRPC RESOURCE_EXHAUSTED with the trailer; another client is served meanwhile."""
    url = roles.coordinator.http.url
    sent = await _spend_burst(url, TOKENS["b"])
    async with httpx.AsyncClient(timeout=60) as http:
        refused = await http.post(f"{url}/completions", json=ONE_TOKEN, headers=_auth(TOKENS["b"]))
    elapsed = time.monotonic() - sent
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "retry in" in error["message"]
    wait_s = int(refused.headers["retry-after-ms"]) / 1000
    assert 1 / RATE - elapsed - 0.001 <= wait_s <= 1 / RATE + 0.001, (wait_s, elapsed)
    assert int(refused.headers["retry-after"]) == max(1, -(-int(refused.headers["retry-after-ms"]) // 1000))

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sf.generate(roles.address, sf.request(PROMPT, max_new_tokens=1), metadata=_auth(TOKENS["b"]).items())
    elapsed = time.monotonic() - sent
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hint = float(dict(info.value.trailing_metadata() or ())[RETRY_AFTER_KEY])
    assert 1 / RATE - elapsed - 0.001 <= hint <= 1 / RATE + 0.001, (hint, elapsed)
    assert (await sf.generate(roles.address, sf.request(PROMPT, max_new_tokens=1), metadata=_auth(TOKENS["c"]).items())).stats


async def test_the_sdk_waits_out_the_hint_then_is_served_and_raises_once_its_retries_are_spent(roles):
    url = roles.coordinator.http.url
    await _spend_burst(url, TOKENS["d"])
    refusals = _exhausted()
    async with AsyncClient(roles.address, token=TOKENS["d"], rate_limit_retries=3) as client:
        result = await client.generate(prompt_token_ids=PROMPT, max_new_tokens=1)
    assert len(result.token_ids) == 1
    assert _exhausted() > refusals, "the first attempt was refused (the bucket was empty)"
    # The bucket is empty again (the retry took its session): without retries the SDK raises the hint.
    async with AsyncClient(roles.address, token=TOKENS["d"], rate_limit_retries=0) as client:
        with pytest.raises(errors.ResourceExhausted, match="per second") as info:
            await client.generate(prompt_token_ids=PROMPT, max_new_tokens=1)
    assert 0 < info.value.retry_after_s <= 1 / RATE + 0.001


async def test_an_unauthenticated_local_client_starts_hundreds_of_sessions_at_the_defaults(roles, sec_pair):
    """Finding 7: with the default settings a local client without credentials is not limited per client
    (every client behind one address would share its bucket): 300 one-token sessions from one client, 8 at
    a time, all served, none refused (the issue's 3,000 ran into 20 per second after a burst of 200)."""
    async with extra_coordinator(roles, sec_pair) as app:
        refusals = _exhausted()
        async with AsyncClient(f"127.0.0.1:{app.port}", rate_limit_retries=0) as client:
            gate = asyncio.Semaphore(8)

            async def one(i: int) -> int:
                async with gate:
                    return len((await client.generate(prompt_token_ids=[5, 6, 7, 8 + i % 50], max_new_tokens=1)).token_ids)

            served = await asyncio.gather(*(one(i) for i in range(300)))
        assert served == [1] * 300
        assert _exhausted() == refusals


async def test_by_address_only_with_the_opt_in_and_x_forwarded_for_only_from_a_trusted_proxy(roles, sec_pair):
    limits = {"http_port": 0, "session_rate_per_client": 0.001, "session_burst_per_client": 1}
    spoof = {"x-forwarded-for": "198.51.100.7"}
    # By address, no trusted proxy: every local caller is 127.0.0.1, whatever header it sends.
    async with extra_coordinator(roles, sec_pair, client_limits_by_address=True, **limits) as app:
        url = app.http.url
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.post(f"{url}/completions", json=ONE_TOKEN)).status_code == 200
            assert (await http.post(f"{url}/completions", json=ONE_TOKEN, headers=spoof)).status_code == 429
        with pytest.raises(grpc.aio.AioRpcError) as info:  # gRPC and HTTP share the address's bucket
            await sf.generate(f"127.0.0.1:{app.port}", sf.request(PROMPT, max_new_tokens=1))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Behind a trusted proxy (here: 127.0.0.1), each forwarded address is a client of its own.
    proxied = {"client_limits_by_address": True, "trusted_proxies": ["127.0.0.1"], **limits}
    async with extra_coordinator(roles, sec_pair, **proxied) as app:
        url = app.http.url
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.post(f"{url}/completions", json=ONE_TOKEN, headers=spoof)).status_code == 200
            assert (await http.post(f"{url}/completions", json=ONE_TOKEN, headers=spoof)).status_code == 429
            # What a caller put left of the address the proxy saw is not its address.
            chained = {"x-forwarded-for": "198.51.100.7, 198.51.100.8"}
            assert (await http.post(f"{url}/completions", json=ONE_TOKEN, headers=chained)).status_code == 200
        with pytest.raises(grpc.aio.AioRpcError) as info:  # the same client over gRPC, through the proxy
            await sf.generate(f"127.0.0.1:{app.port}", sf.request(PROMPT, max_new_tokens=1), metadata=spoof.items())
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        out = await sf.generate(f"127.0.0.1:{app.port}", sf.request(PROMPT, max_new_tokens=1))
        assert out.stats is not None, "the proxy itself (no header) is another client"


async def test_a_client_certificate_is_a_client_over_grpc_and_http(roles, sec_pair, pki):
    tls = {"tls_cert_file": pki.server.cert, "tls_key_file": pki.server.key, "tls_ca_file": pki.ca}
    limits = {"http_port": 0, "session_rate_per_client": 0.001, "session_burst_per_client": 1}
    async with extra_coordinator(roles, sec_pair, **tls, **limits) as app:
        address = f"127.0.0.1:{app.port}"

        def client(pair) -> AsyncClient:
            return AsyncClient(
                address, root_certificates=pki.ca, private_key=pair.key, certificate_chain=pair.cert,
                rate_limit_retries=0,
            )  # fmt: skip

        def http(pair) -> httpx.AsyncClient:
            context = ssl.create_default_context(cafile=str(pki.ca))
            context.load_cert_chain(str(pair.cert), str(pair.key))
            return httpx.AsyncClient(verify=context, timeout=60)

        async with http(pki.other_client) as h:  # "intruder": its one session, over HTTP
            assert (await h.post(f"{app.http.url}/completions", json=ONE_TOKEN)).status_code == 200
        async with client(pki.other_client) as c:  # ... so over gRPC it is over its rate
            with pytest.raises(errors.ResourceExhausted):
                await c.generate(prompt_token_ids=PROMPT, max_new_tokens=1)
        async with client(pki.client) as c:  # "coordinator": a client of its own
            assert len((await c.generate(prompt_token_ids=PROMPT, max_new_tokens=1)).token_ids) == 1
        async with http(pki.client) as h:
            assert (await h.post(f"{app.http.url}/completions", json=ONE_TOKEN)).status_code == 429
