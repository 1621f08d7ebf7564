"""Cancel a request's work when its client goes away, so that its engine requests are aborted.

Starlette notices disconnects only while a streaming body is being sent; a non-streaming
request (or a streaming one still waiting for its first tokens) has to listen itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request

from tidegate.engine.entrypoints.openai.errors import ClientDisconnectedError

T = TypeVar("T")


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message the server sends is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work; if the client disconnects first, cancel it and raise ClientDisconnectedError."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this handler itself is cancelled: never leave the work running.
        for task in (work_task, watcher):
            if not task.done():
                task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(work_task, watcher, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnectedError()
    return work_task.result()
