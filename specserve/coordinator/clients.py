"""Who a caller is, for the coordinator's per-client limits (:mod:`specserve.coordinator.admission`).

A caller is named by what authenticated it: its bearer token (by fingerprint, ``token:...``) when
``auth_tokens`` is set, else the name on its client certificate (``tls:...``) when ``tls_ca_file``
(mutual TLS) is set. A caller nothing authenticated has no name (None: only ``max_sessions`` limits
it), unless the operator opts in with ``client_limits_by_address``: then its network address
(:func:`~specserve.runtime.interceptors.peer_key`: the IPv4 address, the IPv6 /64). Behind a proxy
every caller has the proxy's address; with the proxy listed in ``trusted_proxies`` the address is
read from ``X-Forwarded-For`` instead: its rightmost entry that is not itself a trusted proxy (the
one the first trusted proxy saw). The header is ignored from any other peer, so a caller cannot
pick its own address. The gRPC and the HTTP API name a caller alike. docs/operations.md, "Limits".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.interceptors import bearer_token, peer_host, peer_key, token_fingerprint

#: The header (gRPC metadata key) a trusted proxy names the caller's address in.
FORWARDED_FOR = "x-forwarded-for"
#: The key of an HTTP request's ASGI state that holds its client certificate's name (specserve/coordinator/http_server.py).
TLS_CLIENT_NAME = "specserve_tls_client_name"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def certificate_name(common_names: Iterable[str], alternative_names: Iterable[str]) -> str | None:
    """The one name of a verified client certificate: its common name, else its first DNS alternative
    name in sorted order (None: it has neither)."""
    for name in common_names:
        return name
    return min(alternative_names, default=None)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a proxy writes it (``1.2.3.4``, ``1.2.3.4:5678``, ``[2001:db8::1]:5678``, ``::1``)."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True)
class ClientKeys:
    """How this coordinator names its callers; see the module docstring."""

    by_token: bool = False
    by_certificate: bool = False
    by_address: bool = False
    trusted_proxies: tuple[Network, ...] = ()

    @classmethod
    def from_settings(cls, settings: CoordinatorSettings) -> ClientKeys:
        return cls(
            by_token=bool(settings.auth_tokens),
            by_certificate=settings.tls_ca_file is not None,
            by_address=settings.client_limits_by_address,
            trusted_proxies=tuple(ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies),
        )

    def key(
        self,
        *,
        token: str | None,
        certificate: str | None,
        peer: str,
        forwarded_for: Sequence[str] = (),
    ) -> str | None:
        """The caller's name: by ``token``, ``certificate`` (its name), or address (``peer``, and
        ``forwarded_for``, the header's values, where ``peer`` is a trusted proxy); None: unnamed."""
        if self.by_token and token:
            return f"token:{token_fingerprint(token)}"
        if self.by_certificate and certificate:
            return f"tls:{certificate}"
        if not self.by_address:
            return None
        return peer_key(self.address(peer_host(peer), forwarded_for))

    def address(self, host: str, forwarded_for: Sequence[str]) -> str:
        """The caller's address: ``host``, or, where ``host`` is a trusted proxy, the rightmost entry of
        ``forwarded_for`` that is not a trusted proxy (the leftmost entry when all are)."""
        if not self._trusted(host):
            return host
        hops = [hop.strip() for value in forwarded_for for hop in value.split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self._trusted(hop):
                address = _address(hop)
                return hop if address is None else str(address)
        return str(_address(hops[0]) or hops[0]) if hops else host

    def _trusted(self, host: str) -> bool:
        address = _address(host)
        return address is not None and any(address in network for network in self.trusted_proxies)

    def of_call(self, context: grpc.aio.ServicerContext) -> str | None:
        """The name of a gRPC call's caller."""
        metadata = context.invocation_metadata() or ()
        auth: Mapping[str, Sequence[bytes]] = context.auth_context() if self.by_certificate else {}
        return self.key(
            token=bearer_token(metadata),
            certificate=certificate_name(
                (_text(v) for v in auth.get("x509_common_name", ())),
                (_text(v) for v in auth.get("x509_subject_alternative_name", ())),
            ),
            peer=context.peer() or "unknown",
            forwarded_for=[_text(v) for k, v in metadata if k == FORWARDED_FOR],
        )


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
