"""Who may call the API: the key's sources, and a Bearer check ahead of everything else."""

from __future__ import annotations

import hmac
import os
from collections.abc import Collection, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from tidegate.engine.config import API_KEY_ENV, TenancyArgs
from tidegate.engine.entrypoints.openai.errors import error_response, invalid_api_key


def load_api_key(args: TenancyArgs, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key from --api-key, --api-key-file or TIDEGATE_API_KEY, in that order; None: open.

    Raises ValueError, in words for the operator, when a key is given twice or its file
    cannot be read or is empty (an empty key would be no key at all).
    """
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if args.api_key is not None:
        key = args.api_key.get_secret_value()
        if not key:
            raise ValueError("--api-key is empty; leave it out to serve without a key")
        return key
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise ValueError(f"cannot read --api-key-file {args.api_key_file}: {reason}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return environ.get(API_KEY_ENV) or None


def tenant_cache_salt(headers: Mapping[str, str], header: str) -> str | None:
    """The cache_salt of a request whose tenant the gateway names in `header`; None if unnamed.

    Only the header counts: a client that could pick its own salt could pick another
    tenant's, and time its requests to learn which prefixes that tenant has cached.
    """
    return headers.get(header) or None


class APIKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <key>` matches; open_paths need no key.

    The comparison takes the same time wherever the first wrong byte is, so response times
    do not reveal how much of a guess was right.
    """

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
