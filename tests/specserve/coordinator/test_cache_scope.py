"""specserve/coordinator/cache_scope.py: a session's tenant and salt, and the prefix-cache scope hashed from them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specserve.coordinator.cache_scope import ANONYMOUS, SCOPE_BYTES, cache_scope, http_tenant, tenant
from specserve.runtime.config import CoordinatorSettings

pytestmark = pytest.mark.unit


def test_the_tenant_is_the_authenticated_identity_and_anonymous_without_one():
    assert tenant("tok-1", by_token=True) != tenant("tok-2", by_token=True)
    assert tenant("tok-1", by_token=True) == tenant("tok-1", ["svc"], by_token=True)  # the token comes first
    assert "tok-1" not in tenant("tok-1", by_token=True)  # the token itself is never kept
    assert tenant(None, ["svc-a"], by_token=False) != tenant(None, ["svc-b"], by_token=False)
    assert tenant(None, ["b", "a"], by_token=False) == tenant(None, ["a", "b", "a"], by_token=False)
    # Without client authentication every caller is one tenant, whatever it sends.
    assert tenant("anything", by_token=False) == tenant(None, by_token=False) == ANONYMOUS
    assert http_tenant("Bearer tok-1", by_token=True) == tenant("tok-1", by_token=True)
    assert http_tenant(None, by_token=False) == http_tenant("Bearer x", by_token=False) == ANONYMOUS


def test_scopes_separate_tenants_and_salts_and_shared_mode_joins_tenants_only():
    a, b = tenant("tok-a", by_token=True), tenant("tok-b", by_token=True)
    scoped = {cache_scope(t, s, mode="tenant") for t in (a, b, ANONYMOUS) for s in (None, "s1", "s2")}
    assert len(scoped) == 9 and all(len(x) == SCOPE_BYTES for x in scoped)
    assert cache_scope(a, "s1", mode="tenant") == cache_scope(a, "s1", mode="tenant")
    assert cache_scope(a, "s1", mode="shared") == cache_scope(b, "s1", mode="shared")
    assert cache_scope(a, None, mode="shared") != cache_scope(a, "s1", mode="shared")
    assert not {cache_scope(t, None, mode="shared") for t in (a, b)} & scoped
    assert b"tok-a" not in cache_scope(a, None, mode="tenant")


def test_prefix_cache_scope_is_tenant_by_default_and_checked():
    assert CoordinatorSettings(host="127.0.0.1").prefix_cache_scope == "tenant"
    assert CoordinatorSettings(host="127.0.0.1", prefix_cache_scope="shared").prefix_cache_scope == "shared"
    with pytest.raises(ValidationError, match="prefix_cache_scope"):
        CoordinatorSettings(host="127.0.0.1", prefix_cache_scope="everyone")
    with pytest.raises(ValueError, match="'tenant' or 'shared'"):
        cache_scope(ANONYMOUS, None, mode="everyone")
