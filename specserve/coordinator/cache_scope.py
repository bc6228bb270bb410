"""Who may share a session's cached prefix: its tenant and salt, hashed into the scope the workers key blocks by.

The workers' prefix caches (docs/design.md, "The prefix cache") attach a shared block only to sessions of
the *cache scope* it was made under. The coordinator derives each session's scope from

* its **tenant**, the authenticated client (:func:`tenant`): ``token:<sha-256 of its bearer token>`` where
  the coordinator checks ``auth_tokens``; else ``cert:<names>`` of a verified client certificate (mutual
  TLS on the gRPC API); else :data:`ANONYMOUS`: a deployment that does not authenticate its clients is one
  tenant. With ``prefix_cache_scope="shared"`` every client counts as the same tenant;
* its **salt**: ``GenerateRequest.cache_salt`` (over HTTP, ``cache_salt`` and ``prompt_cache_key``).

:func:`cache_scope` hashes the two (blake2b), so a worker sees neither the token nor the salt. The scope
travels with every Verify item and Propose (``VerifyItem.cache_scope``, ``ProposeRequest.cache_scope``), and
routing by prefix keys on it too (:func:`specserve.coordinator.fleet.routing.prefix_key`), so one tenant's guess at another's
prompt finds no cached block, no faster first token and no replica of the other's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from specserve.runtime.interceptors import bearer_token, certificate_names

#: The tenant of a client the coordinator does not authenticate (all of them, without client auth).
ANONYMOUS = "anonymous"
#: Bytes of a scope (blake2b digest size): collisions between scopes are out of reach.
SCOPE_BYTES = 16


def tenant(token: str | None, names: Iterable[str] = (), *, by_token: bool) -> str:
    """The tenant of a caller: its bearer ``token`` where ``by_token`` (the coordinator checks
    ``auth_tokens``, so the token is one of them), else the ``names`` of its verified client certificate,
    else :data:`ANONYMOUS`."""
    if by_token and token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()
    chosen = sorted(set(names))
    if chosen:
        return "cert:" + json.dumps(chosen)
    return ANONYMOUS


def grpc_tenant(context: Any, *, by_token: bool) -> str:
    """:func:`tenant` of a gRPC call (``grpc.aio.ServicerContext``)."""
    return tenant(
        bearer_token(context.invocation_metadata()), certificate_names(context.auth_context()), by_token=by_token
    )


def http_tenant(authorization: str | None, *, by_token: bool) -> str:
    """:func:`tenant` of an HTTP request with this ``Authorization`` header (the HTTP server does not see
    client certificates: with mutual TLS alone its clients are one tenant)."""
    token = bearer_token([("authorization", authorization)] if authorization is not None else [])
    return tenant(token, by_token=by_token)


def cache_scope(tenant_id: str, salt: str | None, *, mode: str) -> bytes:
    """The cache scope of a session of ``tenant_id`` with ``salt`` (None: unsalted) under the setting
    ``prefix_cache_scope`` (``mode``): ``"tenant"`` keeps tenants apart, ``"shared"`` lets every tenant
    share (the salt still separates)."""
    if mode not in ("tenant", "shared"):
        raise ValueError(f"prefix_cache_scope must be 'tenant' or 'shared', got {mode!r}")
    owner = tenant_id if mode == "tenant" else None
    material = json.dumps([owner, salt]).encode()
    return hashlib.blake2b(material, digest_size=SCOPE_BYTES, person=b"specserve-scope").digest()
