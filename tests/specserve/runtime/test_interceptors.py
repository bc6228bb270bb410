"""specserve.runtime.interceptors: who a caller is, for per-client limits (pure functions; the interceptors
themselves run against real servers in tests/security)."""

from __future__ import annotations

import pytest

from specserve.runtime.interceptors import (
    MAX_REQUEST_ID_CHARS,
    MAX_REQUEST_IDS_CHARS,
    certificate_names,
    clean_request_ids,
    peer_key,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "peer, key",
    [
        ("ipv4:203.0.113.7:50000", "peer:203.0.113.7"),
        # IPv6: one /64 is one client, however many addresses of it a caller uses (as gRPC writes them).
        ("ipv6:%5B2001:db8:1:2::1%5D:50000", "peer:2001:db8:1:2::/64"),
        ("ipv6:%5B2001:db8:1:2:ffff:eeee:dddd:cccc%5D:1", "peer:2001:db8:1:2::/64"),
        ("ipv6:[2001:db8:1:2::9]:7", "peer:2001:db8:1:2::/64"),
        ("ipv6:%5B2001:db8:1:3::1%5D:50000", "peer:2001:db8:1:3::/64"),
        ("ipv6:%5B::ffff:203.0.113.7%5D:1", "peer:203.0.113.7"),  # IPv4-mapped: its IPv4 address
        ("ipv6:%5Bfe80::1%25eth0%5D:3", "peer:fe80::/64"),  # a zone id is not part of the address
        ("unix:/run/specserve.sock", "peer:unix:/run/specserve.sock"),
    ],
)
def test_the_per_client_key_is_the_ipv4_address_or_the_ipv6_slash_64(peer, key):
    assert peer_key(peer) == key


def test_certificate_names_are_the_common_name_and_the_dns_alternative_names():
    context = {
        "x509_common_name": [b"coordinator"],
        "x509_subject_alternative_name": [b"coordinator.specserve.svc", b"localhost"],
        "transport_security_type": [b"ssl"],
    }
    assert certificate_names(context) == {"coordinator", "coordinator.specserve.svc", "localhost"}
    assert certificate_names({}) == set() and certificate_names(None) == set()


def test_request_ids_are_printable_ascii_cut_to_their_cap_and_joined_under_gRPCs_limit():
    assert clean_request_ids(None) is None and clean_request_ids(["", " \t"]) is None
    assert clean_request_ids("req 1\x00\u00e9,req-2,req-2") == "req1,req-2"
    assert clean_request_ids("x" * 10_000) == "x" * MAX_REQUEST_ID_CHARS
    many = clean_request_ids([f"{i:0{MAX_REQUEST_ID_CHARS}d}" for i in range(100)])
    assert many is not None and len(many) <= MAX_REQUEST_IDS_CHARS
    kept = many.split(",")
    assert kept[-1] == f"+{100 - (len(kept) - 1)}" and len(kept) > 20
    assert clean_request_ids(["a" * 9000, "b" * 9000]) == f"{'a' * MAX_REQUEST_ID_CHARS},{'b' * MAX_REQUEST_ID_CHARS}"
