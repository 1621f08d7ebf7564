"""Passing a decode instance's response to the client as it arrives, and cleaning up after."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tidegate.engine.entrypoints.openai.sse import DONE
from tidegate.engine.router.errors import sse_error_event

logger = logging.getLogger("tidegate.router")

# Upstream headers that mean something to the client; hop-by-hop ones (length, encoding,
# connection) describe the upstream connection, not this one.
RELAYED_HEADERS = ("content-type", "retry-after", "www-authenticate", "x-request-id")

Outcome = Literal["done", "client_gone", "broken"]


class UpstreamBrokenError(RuntimeError):
    """An instance died while its (non-streaming) response was being relayed."""


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    """The upstream headers a client should see."""
    return {name: response.headers[name] for name in RELAYED_HEADERS if name in response.headers}


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone away (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """Streams an open upstream response; closes it when done, broken, or the client leaves.

    Closing the upstream connection is what tells the engine to abort the request, so it
    happens at once on a client disconnect, not when the engine next writes.
    """

    def __init__(
        self, upstream: httpx.Response, on_close: Callable[[Outcome], Awaitable[None]]
    ) -> None:
        self.upstream = upstream
        self.on_close = on_close
        self.status_code = upstream.status_code
        self.background = None
        self.is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        headers = relayed_headers(upstream)
        if self.is_sse:
            # Proxies in front of us (nginx) must not buffer the stream either.
            headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: Outcome = "client_gone"
        try:
            async with anyio.create_task_group() as group:

                async def relay() -> None:
                    nonlocal outcome
                    try:
                        outcome = await self._relay(send)
                    except OSError:  # the client's socket broke while we wrote to it
                        outcome = "client_gone"
                    group.cancel_scope.cancel()

                group.start_soon(relay)
                await wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
                await self.on_close(outcome)
        if outcome == "broken" and not self.is_sse:
            # No way to say "error" after a 200 has started but to cut the connection: a
            # truncated JSON body with a clean end would look like a server bug to the client.
            raise UpstreamBrokenError(f"{self.upstream.url} closed the response part-way")

    async def _relay(self, send: Send) -> Outcome:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in self.upstream.aiter_bytes():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as error:
            logger.warning("%s broke off its response: %r", self.upstream.url, error)
            if not self.is_sse:
                return "broken"
            # As an engine ends a stream that fails: an error event, then [DONE], so that a
            # client sees the same whichever process died.
            message = f"the decode instance failed mid-stream: {error!r}"
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_error_event(message) + DONE.encode(),
                    "more_body": True,
                }
            )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "broken"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return "done"
