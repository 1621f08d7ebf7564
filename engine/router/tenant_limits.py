"""Per-tenant limits at the router: a flood is refused here, before any instance sees it.

Each engine refuses a tenant's request past its own limits (--max-waiting-per-tenant, and
--max-running-per-tenant holds its other requests back). The router counts each tenant's
requests in flight through it, from arrival to the end of the response or stream, and
answers 429 once a tenant has (running + waiting limit) of them per healthy instance of the
pool that serves them, what the instances together would hold of it. Tenants are named as
the engines name them (engine/entrypoints/openai/tenants.py). Each router replica counts
its own requests: its HTTP traffic here (TenantLimitMiddleware), and the requests its
endpoint picker routes for a gateway (router/epp.py), each against the same limit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tidegate.engine.entrypoints.openai.errors import OpenAIError, error_response
from tidegate.engine.entrypoints.openai.tenants import request_tenant
from tidegate.engine.router import errors

Tenant = str | None


class TenantCounts:
    """Each tenant's requests in flight, and the limit: `per_instance` times the healthy
    instances that `instances` counts (at least one counts, so that requests a pool at zero
    holds for its first instance are limited too)."""

    def __init__(self, per_instance: int, instances: Callable[[], int]) -> None:
        self.per_instance = per_instance
        self.instances = instances
        # Tenant -> its requests in flight; a tenant with none has no entry.
        self.in_flight: dict[Tenant, int] = {}

    def admit(self, tenant: Tenant) -> OpenAIError | None:
        """Count one more request of `tenant`; the 429 instead when it is at its limit."""
        count = self.in_flight.get(tenant, 0)
        limit = self.per_instance * max(1, self.instances())
        if count >= limit:
            return errors.tenant_limit(count, limit, self.per_instance)
        self.in_flight[tenant] = count + 1
        return None

    def release(self, tenant: Tenant) -> None:
        """One request of `tenant`, admitted earlier, has ended."""
        left = self.in_flight[tenant] - 1
        if left:
            self.in_flight[tenant] = left
        else:
            del self.in_flight[tenant]


class TenantLimitMiddleware:
    """Counts requests in flight per tenant on `paths`; a 429 past the limit."""

    def __init__(
        self,
        app: ASGIApp,
        per_instance: int,
        instances: Callable[[], int],
        paths: Collection[str],
        cache_salt_header: str | None,
        keyed: bool,
    ) -> None:
        self.app = app
        self.counts = TenantCounts(per_instance, instances)
        self.paths = frozenset(paths)
        self.cache_salt_header = cache_salt_header
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        tenant = request_tenant(Headers(scope=scope), self.cache_salt_header, self.keyed)
        refusal = self.counts.admit(tenant)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.counts.release(tenant)
