"""Tenant salts: one per API key, stable, never the key; a request's own salt scoped inside its tenant."""
from __future__ import annotations

import pytest

from server.api.protocol import APIError
from server.cache.cache_salt import effective_salt, tenant_salt


def test_tenant_salts_are_stable_distinct_and_not_the_key() -> None:
    assert tenant_salt(None) is None
    a, b = tenant_salt("sk-a"), tenant_salt("sk-b")
    assert a == tenant_salt("sk-a") and a != b and "sk-a" not in a


def test_request_salt_is_scoped_inside_the_tenant_and_needs_permission() -> None:
    tenant = tenant_salt("sk-a")
    assert effective_salt(tenant, None, allow_request_salt=False) == tenant
    with pytest.raises(APIError) as err:
        effective_salt(tenant, "user-1", allow_request_salt=False)
    assert err.value.status == 400 and err.value.param == "cache_salt"
    scoped = effective_salt(tenant, "user-1", allow_request_salt=True)
    assert scoped != effective_salt(tenant_salt("sk-b"), "user-1", allow_request_salt=True)
    assert scoped != effective_salt(None, "user-1", allow_request_salt=True)
    # No way to spell one tenant's scoped salt from another tenant (or from no tenant).
    assert effective_salt(None, f"{len(tenant)}:{tenant}:user-1", allow_request_salt=True) != scoped
