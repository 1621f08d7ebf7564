"""Per-tenant limits at the router: a flood is refused here, before any instance sees it.

Each engine refuses a tenant's request past its own limits (--max-waiting-per-tenant, and
--max-running-per-tenant holds its other requests back). The router counts each tenant's
requests in flight through it, from arrival to the end of the response or stream, and
answers 429 once a tenant has (running + waiting limit) of them per healthy instance of the
pool that serves them, what the instances together would hold of it. Tenants are named as
the engines name them (engine/entrypoints/openai/tenants.py). Each router replica counts
its own requests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tidegate.engine.entrypoints.openai.errors import error_response
from tidegate.engine.entrypoints.openai.tenants import request_tenant
from tidegate.engine.router import errors


class TenantLimitMiddleware:
    """Counts requests in flight per tenant on `paths`; a 429 past the limit.

    `instances` says how many healthy instances serve the requests now (at least one counts,
    so that requests a pool at zero holds for its first instance are limited too).
    """

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
        self.per_instance = per_instance
        self.instances = instances
        self.paths = frozenset(paths)
        self.cache_salt_header = cache_salt_header
        self.keyed = keyed
        # Tenant -> its requests in flight; a tenant with none has no entry.
        self.in_flight: dict[str | None, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        tenant = request_tenant(Headers(scope=scope), self.cache_salt_header, self.keyed)
        count = self.in_flight.get(tenant, 0)
        limit = self.per_instance * max(1, self.instances())
        if count >= limit:
            refusal = errors.tenant_limit(count, limit, self.per_instance)
            await error_response(refusal)(scope, receive, send)
            return
        self.in_flight[tenant] = count + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[tenant] - 1
            if left:
                self.in_flight[tenant] = left
            else:
                del self.in_flight[tenant]
