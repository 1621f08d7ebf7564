"""Who may call the API: the keys' sources, a key file followed as it changes, and a Bearer
check ahead of everything else."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Collection, Iterable, Mapping
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from tidegate.engine.config import API_KEY_ENV, TenancyArgs
from tidegate.engine.entrypoints.openai.errors import OpenAIError, error_response, invalid_api_key

logger = logging.getLogger("tidegate.auth")

# How often --api-key-file is read again. The kubelet takes up to a minute or two to bring a
# changed Secret into the pod; a second more is nothing beside that, and a read of a few bytes
# from the Secret's tmpfs each second costs nothing either.
KEY_FILE_POLL_S = 1.0


def parse_api_keys(text: str) -> list[str]:
    """The keys of a key file: one a line, whitespace around each stripped; blank lines and
    lines starting with `#` skipped; a key listed twice counted once."""
    keys = (line.strip() for line in text.split("\n"))
    return list(dict.fromkeys(key for key in keys if key and not key.startswith("#")))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class APIKeys:
    """The keys that open the API now; with `path`, `reload` follows that file's changes.

    Only each key's SHA-256 digest is kept: a token is compared, digest to digest, with every
    key (never stopping at a match), so the time a check takes depends neither on how much of
    a guess was right, nor on the keys' lengths, nor on which key matched.
    """

    def __init__(self, keys: Collection[str], path: str | None = None) -> None:
        self.path = path
        self._digests = tuple(_digest(key.encode()) for key in keys)
        self._file_digest: bytes | None = None  # of the file's bytes, as last read
        self._problem: str | None = None  # what is wrong with the file, as last logged

    @classmethod
    def from_file(cls, path: str) -> APIKeys:
        """The keys in `path`; ValueError, in words for the operator, when there are none."""
        raw, keys = _read_key_file(path)
        logger.info("--api-key-file %s read: keys valid now: %d", path, len(keys))
        found = cls(keys, path)
        found._file_digest = _digest(raw)
        return found

    def matches(self, token: bytes) -> bool:
        """Whether `token` is one of the keys, in time that does not depend on which."""
        digest = _digest(token)
        found = False
        for key in self._digests:  # one tuple, read once: a reload swaps it whole
            found |= hmac.compare_digest(digest, key)
        return found

    def reload(self) -> bool:
        """Read the file again; True when its keys changed, and they are the keys from now on.

        A file that cannot be read or holds no key changes nothing: the keys read before stay
        valid, and the problem is logged as an error (once, until it changes or clears). Such
        a file is a slip (a Secret emptied by mistake, a file caught mid-write in place) far
        more often than a wish to let nobody in, and serving without a key would let everyone
        in. To stop accepting a key, remove its line.
        """
        assert self.path is not None, "a fixed key has no file to reload"
        try:
            raw, keys = _read_key_file(self.path)
        except ValueError as problem:
            if str(problem) != self._problem:
                logger.error(
                    "%s; the keys read before stay valid (%d)", problem, len(self._digests)
                )
                self._problem = str(problem)
            return False
        if self._problem is not None:
            logger.info("--api-key-file %s is readable again", self.path)
            self._problem = None
        file_digest = _digest(raw)
        if file_digest == self._file_digest:
            return False
        self._file_digest = file_digest
        before, after = set(self._digests), {_digest(key.encode()) for key in keys}
        if after == before:
            return False  # only comments, order or spacing changed
        self._digests = tuple(after)
        logger.info(
            "--api-key-file %s changed: keys valid now: %d (%d added, %d removed)",
            self.path,
            len(after),
            len(after - before),
            len(before - after),
        )
        return True

    async def follow(self, interval: float = KEY_FILE_POLL_S) -> None:
        """Reload every `interval` seconds until cancelled. The file's content is compared, not
        its path's metadata: a mounted Secret changes by a symlink swap, and a file edited in
        place may keep its size and, within a clock tick, its mtime. The read runs in a thread,
        so that a stuck filesystem never stalls the requests."""
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.reload)


def _read_key_file(path: str) -> tuple[bytes, list[str]]:
    """The file's bytes and its keys; ValueError, saying what is wrong, when it holds none."""
    try:
        raw = Path(path).read_bytes()
        keys = parse_api_keys(raw.decode("utf-8"))
    except UnicodeDecodeError:
        # Not the error's own words: they would quote a byte of the file.
        raise ValueError(f"--api-key-file {path} is not UTF-8 text") from None
    except OSError as error:
        raise ValueError(f"cannot read --api-key-file {path}: {error.strerror or error}") from None
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return raw, keys


def as_api_keys(key: APIKeys | str | None) -> APIKeys | None:
    """`key` as APIKeys: a string is one fixed key; None or an empty string, no key at all."""
    if isinstance(key, str):
        return APIKeys([key]) if key else None
    return key


@contextlib.asynccontextmanager
async def following_key_file(keys: APIKeys | None) -> AsyncIterator[None]:
    """While open, the keys follow their file (nothing happens for a fixed key or none)."""
    if keys is None or keys.path is None:
        yield
        return
    task = asyncio.create_task(keys.follow(), name="api-key-file")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def load_api_keys(args: TenancyArgs, environ: Mapping[str, str] = os.environ) -> APIKeys | None:
    """The keys from --api-key, --api-key-file or TIDEGATE_API_KEY, in that order; None: open.

    Only the file may hold several keys (one a line), and only the file is followed as it
    changes. Raises ValueError, in words for the operator, when a key is given twice or the
    file cannot be read or holds no key (an empty key would be no key at all).
    """
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if args.api_key is not None:
        key = args.api_key.get_secret_value()
        if not key:
            raise ValueError("--api-key is empty; leave it out to serve without a key")
        return APIKeys([key])
    if args.api_key_file is not None:
        return APIKeys.from_file(args.api_key_file)
    return as_api_keys(environ.get(API_KEY_ENV))


def tenant_cache_salt(headers: Mapping[str, str], header: str) -> str | None:
    """The cache_salt of a request whose tenant the gateway names in `header`; None if unnamed.

    Only the header counts: a client that could pick its own salt could pick another
    tenant's, and time its requests to learn which prefixes that tenant has cached.
    """
    return headers.get(header) or None


def key_refusal(authorization: bytes | None, keys: APIKeys) -> OpenAIError | None:
    """The 401 for a request with this Authorization header; None when it names a valid key."""
    if authorization is None:
        return invalid_api_key(missing=True)
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not keys.matches(token.strip()):
        return invalid_api_key(missing=False)
    return None


class APIKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <key>` names one of `keys`; open_paths need
    no key. The keys are looked up per request, so a reload takes effect at the next one."""

    def __init__(self, app: ASGIApp, keys: APIKeys, open_paths: Iterable[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        refusal = key_refusal(dict(scope["headers"]).get(b"authorization"), self.keys)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)
