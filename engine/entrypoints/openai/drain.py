"""The API server's side of a drain: count requests in flight, refuse new ones once it starts.

`engine/http_server.py` owns the drain's life (a stop signal starts it, the server stops
listening when it is done); this middleware keeps its count and answers for it: /health and
every new request get a 503 in OpenAI's error body from the signal on, so that readiness
probes and routers turn away at once, while the requests already in flight finish.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from tidegate.engine.entrypoints.openai.errors import OpenAIError, error_response
from tidegate.engine.http_server import DRAINING_HEADER, Drain

# Still answered while draining: scrapers read the last requests' metrics.
DRAIN_OPEN_PATHS = ("/metrics", "/version")


def shutting_down() -> OpenAIError:
    """503: the server has been asked to stop and takes no new request."""
    return OpenAIError(
        503,
        "this server is shutting down: it finishes the requests it has and takes no new ones; "
        "send the request to another instance",
        type="server_error",
        headers={"Retry-After": "1", DRAINING_HEADER: "1"},
    )


class DrainMiddleware:
    """Counts the HTTP requests in flight in `drain`; refuses new ones while it drains."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in DRAIN_OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await error_response(shutting_down())(scope, receive, send)
            return
        if scope["path"] == "/health":  # not a request to wait for
            await self.app(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
