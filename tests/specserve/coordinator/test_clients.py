"""specserve.coordinator.clients.ClientKeys: who a caller is for the per-client limits. Authenticated callers by their
token or certificate; others by address only with the operator's opt-in; X-Forwarded-For only from a
trusted proxy."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import SecretStr, ValidationError

from specserve.coordinator.clients import ClientKeys, certificate_name
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.interceptors import token_fingerprint

pytestmark = pytest.mark.unit

PROXIES = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))


def test_by_default_an_unauthenticated_caller_has_no_name():
    """Every local client (and every client behind one proxy) would otherwise share one bucket."""
    keys = ClientKeys.from_settings(CoordinatorSettings(host="127.0.0.1"))
    assert keys.key(token=None, certificate=None, peer="ipv4:127.0.0.1:5000") is None
    assert keys.key(token="made-up", certificate=None, peer="127.0.0.1") is None, "a token auth did not check"


def test_an_authenticated_caller_is_its_token_or_its_certificate():
    keys = ClientKeys.from_settings(CoordinatorSettings(host="127.0.0.1", auth_tokens=[SecretStr("sekrit")]))
    assert keys.key(token="sekrit", certificate=None, peer="127.0.0.1") == f"token:{token_fingerprint('sekrit')}"
    tls = ClientKeys(by_certificate=True)
    assert tls.key(token=None, certificate="alice", peer="ipv4:10.1.2.3:1") == "tls:alice"
    assert certificate_name(["alice"], ["b.example", "a.example"]) == "alice"
    assert certificate_name([], ["b.example", "a.example"]) == "a.example"
    assert certificate_name([], []) is None


def test_by_address_only_with_the_opt_in():
    keys = ClientKeys(by_address=True)
    assert keys.key(token=None, certificate=None, peer="ipv4:203.0.113.7:5000") == "peer:203.0.113.7"
    assert keys.key(token=None, certificate=None, peer="2001:db8:1:2::9") == "peer:2001:db8:1:2::/64"


def test_x_forwarded_for_is_read_from_trusted_proxies_only():
    keys = ClientKeys(by_address=True, trusted_proxies=PROXIES)
    # From a caller that is no trusted proxy, the header is the caller's own claim: ignored.
    spoofed = keys.key(token=None, certificate=None, peer="ipv4:203.0.113.7:1", forwarded_for=["198.51.100.1"])
    assert spoofed == "peer:203.0.113.7"
    # From a trusted proxy: the address it saw (the rightmost entry not itself a trusted proxy); what the
    # caller wrote to the left of it is ignored.
    via = keys.key(
        token=None, certificate=None, peer="ipv4:10.0.0.5:1", forwarded_for=["1.1.1.1, 198.51.100.9", "10.2.0.1"]
    )
    assert via == "peer:198.51.100.9"
    assert keys.key(token=None, certificate=None, peer="[fd00::1]", forwarded_for=["[2001:db8::5]:443"]) == (
        "peer:2001:db8::/64"
    )
    assert keys.key(token=None, certificate=None, peer="10.0.0.5", forwarded_for=["198.51.100.9:8080"]) == (
        "peer:198.51.100.9"
    )
    # A trusted proxy that sent no header: the proxy itself.
    assert keys.key(token=None, certificate=None, peer="10.0.0.5") == "peer:10.0.0.5"
    # Two callers behind one proxy are two clients.
    a = keys.key(token=None, certificate=None, peer="10.0.0.5", forwarded_for=["198.51.100.1"])
    b = keys.key(token=None, certificate=None, peer="10.0.0.5", forwarded_for=["198.51.100.2"])
    assert a != b


def test_proxy_settings_that_could_not_work_are_refused():
    with pytest.raises(ValidationError, match="client_limits_by_address"):
        CoordinatorSettings(host="127.0.0.1", trusted_proxies="10.0.0.0/8")
    with pytest.raises(ValidationError, match="not an IP address or network"):
        CoordinatorSettings(host="127.0.0.1", client_limits_by_address=True, trusted_proxies="proxy.local")
    settings = CoordinatorSettings(host="127.0.0.1", client_limits_by_address=True, trusted_proxies="10.0.0.0/8, ::1")
    assert ClientKeys.from_settings(settings).trusted_proxies == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
