"""The router's HTTP surface: the OpenAI completion routes, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.auth import (
    APIKeyMiddleware,
    APIKeys,
    as_api_keys,
    following_key_file,
    tenant_cache_salt,
)
from tidegate.engine.entrypoints.openai.errors import (
    CLIENT_CLOSED_REQUEST,
    OpenAIError,
    error_response,
    to_openai_error,
)
from tidegate.engine.entrypoints.openai.pd_bodies import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    POOLING_PATHS,
)
from tidegate.engine.router import errors
from tidegate.engine.router.epp import serve_endpoint_picker
from tidegate.engine.router.health import HealthMonitor
from tidegate.engine.router.proxy import Proxy
from tidegate.engine.router.relay import wait_for_disconnect
from tidegate.engine.router.tenant_limits import TenantLimitMiddleware

logger = logging.getLogger("tidegate.router")

ROUTED_PATHS = (
    COMPLETIONS_PATH,
    CHAT_PATH,
    *POOLING_PATHS,
    "/v1/models",
    "/health",
    "/live",
    "/metrics",
)
# Probes and scrapers reach these without the API key.
OPEN_PATHS = ("/health", "/live", "/metrics")


def build_app(args: RouterArgs, api_key: APIKeys | str | None = None) -> Starlette:
    """The router as an ASGI app; its lifespan runs the HTTP client, the health checks and
    the following of the key file.

    With `api_key`, the router checks it before any leg starts; the instances check it again.
    With the per-tenant limits, a tenant's requests in flight are bounded before any leg
    starts as well (router/tenant_limits.py).
    """
    keys = as_api_keys(api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Internal traffic: no HTTP(S)_PROXY from the environment, no cap on connections
        # (a pool limit would queue requests inside the router, invisible to every metric).
        # Idle connections are dropped well before uvicorn's 5 s keep-alive timeout, so that
        # the router never reuses one the engine is closing and takes that for a dead engine.
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0
        )
        async with (
            httpx.AsyncClient(limits=limits, trust_env=False) as client,
            following_key_file(keys),
        ):
            proxy = Proxy(args, client)
            seeds = {"prefill": args.prefill, "decode": args.decode}
            monitor = HealthMonitor(
                proxy.pools,
                seeds,
                client,
                args.health_interval,
                args.connect_timeout,
                keep_single_name=args.epp_port is None,
            )
            proxy.holding.on_hold = monitor.wake
            # One round before serving, so that /health and the first requests are right.
            await monitor.run_round()
            app.state.proxy = proxy
            app.state.cache_salt_header = args.cache_salt_header
            # The Gateway API Inference Extension's endpoint picker (router/epp.py).
            epp = None if args.epp_port is None else await serve_endpoint_picker(args, proxy, keys)
            app.state.epp_port = None if epp is None else epp.port
            if epp is not None:
                monitor.on_round = epp.refresh_health
            checking = asyncio.create_task(monitor.run(), name="router-health")
            try:
                yield
            finally:
                if epp is not None:
                    await epp.stop()
                checking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checking
                if proxy.index is not None:
                    await proxy.index.close()

    routes = [
        Route(COMPLETIONS_PATH, _completion, methods=["POST"]),
        Route(CHAT_PATH, _completion, methods=["POST"]),
        # Embeddings, classification, scores and reranking: one leg to a decode (or unified)
        # instance, which computes the inputs itself.
        *(Route(path, _completion, methods=["POST"]) for path in POOLING_PATHS),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/live", _live, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    handlers = {
        OpenAIError: _openai_error,
        HTTPException: _http_error,
        Exception: _unexpected_error,
    }
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)  # type: ignore[arg-type]
    if args.max_in_flight_per_tenant is not None:
        # Inside the key check: a request without a valid key counts for nobody.
        app.add_middleware(
            TenantLimitMiddleware,
            per_instance=args.max_in_flight_per_tenant,
            instances=lambda: len(app.state.proxy.pools["decode"].healthy()),
            paths=(COMPLETIONS_PATH, CHAT_PATH, *POOLING_PATHS),
            cache_salt_header=args.cache_salt_header,
            keyed=keys is not None,
        )
    if keys is not None:
        app.add_middleware(APIKeyMiddleware, keys=keys, open_paths=OPEN_PATHS)
    return app


async def _completion(request: Request) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as error:
        return error_response(errors.not_json(str(error)))
    if not isinstance(body, dict):
        return error_response(errors.not_json(f"got a JSON {type(body).__name__}"))
    header = request.app.state.cache_salt_header
    if header is not None:
        body["cache_salt"] = tenant_cache_salt(request.headers, header)
    proxy: Proxy = request.app.state.proxy
    return await _unless_disconnected(
        request, proxy.completion(request.url.path, body, _upstream_headers(request))
    )


async def _models(request: Request) -> Response:
    proxy: Proxy = request.app.state.proxy
    return await _unless_disconnected(request, proxy.models(_upstream_headers(request)))


async def _health(request: Request) -> Response:
    # Ready while every pool can take a request: a pool at zero replicas holds it until an
    # instance is ready, so the router stays in its Service (else none could reach the queue).
    proxy: Proxy = request.app.state.proxy
    held = proxy.held_pools()
    for pool in held.values():
        if not proxy.holding.accepts(pool):
            return error_response(errors.no_instance(pool, proxy.retry_after_s))
    counts = {role: len(pool.healthy()) for role, pool in proxy.pools.items()}
    pending = {name: pool.pending for name, pool in held.items()}
    return JSONResponse({"status": "ok", "healthy": counts, "pending": pending})


async def _live(request: Request) -> Response:
    # For a liveness probe: the router itself runs, whatever the state of the engines.
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request) -> Response:
    proxy: Proxy = request.app.state.proxy
    content, content_type = proxy.metrics.render()
    return Response(content, headers={"content-type": content_type})


def _upstream_headers(request: Request) -> dict[str, str]:
    """What both legs carry: one request id for the client's request, its credentials, its tenant."""
    headers = {
        "content-type": "application/json",
        "x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex,
    }
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    # An instance configured with the same header derives the same salt.
    tenant = request.app.state.cache_salt_header
    if tenant is not None and tenant in request.headers:
        headers[tenant.lower()] = request.headers[tenant]
    return headers


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """The work's response; cancelled (closing its upstream connections) if the client leaves.

    Until a response starts, nothing else watches the client: without this a client that
    gives up would leave its prefill, or a non-streamed generation, running to the end.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _openai_error(request: Request, exc: Exception) -> Response:
    return error_response(to_openai_error(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException) and exc.status_code == 404:
        paths = ", ".join(ROUTED_PATHS)
        message = f"no route {request.method} {request.url.path}; the router serves {paths}"
        return error_response(OpenAIError(404, message, code="not_found"))
    return error_response(to_openai_error(exc))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error serving %s", request.url.path, exc_info=exc)
    return error_response(to_openai_error(exc))
