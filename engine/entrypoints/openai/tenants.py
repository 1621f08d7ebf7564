"""Whose request it is: the tenant that per-tenant limits and fair scheduling count by."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


def request_tenant(
    headers: Mapping[str, str], cache_salt_header: str | None, keyed: bool
) -> str | None:
    """The tenant of a request: the value of `cache_salt_header` (set by an authenticating
    gateway, the same value that becomes its cache_salt), else, when the server checks API
    keys (`keyed`), a digest of the key it came in with, else None: the one anonymous tenant.

    Only a key the server checked names a tenant: on an open server the Authorization header
    is whatever the client likes, and a client could pass for many tenants to escape their
    limits. The key itself is never kept, only its SHA-256.
    """
    if cache_salt_header is not None:
        named = headers.get(cache_salt_header)
        if named:
            return named
    if keyed:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            # Starlette decodes headers as latin-1: this is the token's own bytes.
            digest = hashlib.sha256(token.strip().encode("latin-1")).hexdigest()
            return f"key:{digest[:32]}"
    return None
