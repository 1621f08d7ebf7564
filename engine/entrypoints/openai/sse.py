"""Server-sent events: `data: {json}` per chunk, an error event if the stream fails, `[DONE]`."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tidegate.engine.entrypoints.openai.errors import to_openai_error

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# JSON leaves these unescaped, yet str.splitlines() ends a line at each, and so do clients
# built on it (httpx's aiter_lines, requests' iter_lines with decode_unicode): a generated
# U+2028 would cut an event in two. Escaped, they read the same and the event stays one line.
_UNICODE_LINE_BREAKS = re.compile("[\x85\u2028\u2029]")


def _escape_line_break(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One `data:` event."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False)
    return f"data: {_UNICODE_LINE_BREAKS.sub(_escape_line_break, text)}\n\n"


async def sse_events(batches: AsyncIterator[Sequence[BaseModel]]) -> AsyncIterator[str]:
    """Frame chunks as events, a batch per write; an error after the start is an error event.

    Each chunk is still its own event; the events of a batch (what the engine produced for a
    response since its last write) go out in one piece, since each socket write costs the API
    server more than building the event does.
    """
    try:
        async for batch in batches:
            yield "".join([sse_event(chunk) for chunk in batch])
    except Exception as exc:
        error = to_openai_error(exc)
        if error.status == 500:
            logger.error("a streaming response failed", exc_info=exc)
        yield sse_event(error.body())
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that runs `on_close` however the stream ends.

    Starlette cancels the sending task when the client disconnects, which can leave the
    event generator suspended and unclosed; `on_close` closes the engine iterators regardless.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        # No caching, and no buffering by nginx-style proxies (ingress controllers) either.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    close = getattr(self._events, "aclose", None)
                    if close is not None:
                        await close()
                finally:
                    await self._on_close()
