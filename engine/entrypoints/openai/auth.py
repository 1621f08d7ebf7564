"""Bearer API-key check, ahead of everything else (even before the body is read)."""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from tidegate.engine.entrypoints.openai.errors import error_response, invalid_api_key


class APIKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <key>` matches; open_paths need no key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization")
        if header is None:
            await error_response(invalid_api_key(missing=True))(scope, receive, send)
            return
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            await error_response(invalid_api_key(missing=False))(scope, receive, send)
            return
        await self.app(scope, receive, send)
