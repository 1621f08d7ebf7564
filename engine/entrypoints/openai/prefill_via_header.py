"""Disaggregated serving through a Gateway: a decode server runs the prefill leg itself.

With the Gateway API Inference Extension, the endpoint picker chooses the decode instance a
request goes to and names a prefill instance in the `x-prefiller-host-port` header. A consumer
started with --prefill-via-header sends that instance the prefill leg the router would send
(`pd_bodies.prefill_body`), then serves the request as its decode leg, with the
kv_transfer_params of the answer. A prefill leg that fails costs time, not the request: the
prompt is computed here, as when a KV pull fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.disconnect import cancel_on_disconnect
from tidegate.engine.entrypoints.openai.errors import OpenAIError
from tidegate.engine.entrypoints.openai.pd_bodies import (
    PREFILLER_HEADER,
    needs_prefill,
    prefill_body,
)
from tidegate.engine.entrypoints.openai.protocol import SamplingRequest
from tidegate.engine.kv_transfer.params import RemotePrefill, parse_kv_transfer_params

logger = logging.getLogger(__name__)

# The router's own limits for the same leg (RouterArgs' defaults): a prompt may wait minutes
# behind others on a busy prefill instance, while one that takes seconds to accept a
# connection is gone.
PREFILL_TIMEOUT = httpx.Timeout(
    RouterArgs.model_fields["prefill_timeout"].default,
    connect=RouterArgs.model_fields["connect_timeout"].default,
)
# The prefill instance's headers that mean something to a client it refused.
_RELAYED_HEADERS = ("content-type", "retry-after", "www-authenticate", "x-request-id")

_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_PORT = re.compile(
    rf"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>{_DNS_LABEL}(?:\.{_DNS_LABEL})*))"
    r":(?P<port>[0-9]{1,5})"
)


def prefiller_address(value: str) -> str:
    """The header's `host:port` (IPv4, [IPv6] or a DNS name) as it is; 400 if it is not one.

    Nothing else may pass (no scheme, user, path or percent sign): the value becomes the
    authority of the URL the prompt is sent to.
    """
    match = _HOST_PORT.fullmatch(value)
    valid = match is not None and 1 <= int(match["port"]) <= 65535
    if match is not None and valid:
        if match["ipv6"] is not None:
            valid = _is_ip(ipaddress.IPv6Address, match["ipv6"])
        elif match["host"].replace(".", "").isdigit():
            # Digits and dots only: an IPv4 address, never a DNS name.
            valid = _is_ip(ipaddress.IPv4Address, match["host"])
        else:
            valid = len(match["host"]) <= 253
    if not valid:
        raise OpenAIError(
            400,
            f"the {PREFILLER_HEADER} header must be host:port (an IPv4 address, an IPv6 "
            f"address in brackets, or a DNS name, and a port from 1 to 65535); got {value!r}",
            param=PREFILLER_HEADER,
        )
    return value


def _is_ip(kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address], text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


class AllowedHosts:
    """The prefill hosts a header may name (--prefill-hosts): addresses, or names that stand
    for every address they resolve to (a headless Service: one per ready pod).

    Names are resolved again every REFRESH_S, and at once (at most every MIN_REFRESH_S) when a
    header names an address not known yet: a prefill pod that just became ready is found
    before the next period. None allowed by the list: any host.
    """

    REFRESH_S = 5.0
    MIN_REFRESH_S = 1.0

    def __init__(
        self,
        hosts: list[str],
        resolve: Callable[[str], Awaitable[set[str]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.literal = {_bare(h) for h in hosts}
        self.names = [h for h in hosts if not _is_address(_bare(h))]
        self.resolve = resolve or _resolve
        self.clock = clock
        self.resolved: set[str] = set()
        self.resolved_at: float | None = None

    async def allows(self, host: str) -> bool:
        if not self.literal:
            return True
        host = _bare(host)
        if host in self.literal:
            return True
        if not self.names:
            return False
        now = self.clock()
        age = None if self.resolved_at is None else now - self.resolved_at
        stale = age is None or age >= self.REFRESH_S
        unknown = host not in self.resolved and (age is None or age >= self.MIN_REFRESH_S)
        if stale or unknown:
            await self._refresh(now)
        return host in self.resolved

    async def _refresh(self, now: float) -> None:
        found: set[str] = set()
        for name in self.names:
            try:
                found |= await self.resolve(name)
            except OSError as error:
                logger.warning("cannot resolve prefill host %s: %s", name, error)
        self.resolved, self.resolved_at = found, now


def _bare(host: str) -> str:
    return host.strip().strip("[]").lower()


def _is_address(host: str) -> bool:
    return _is_ip(ipaddress.IPv4Address, host) or _is_ip(ipaddress.IPv6Address, host)


async def _resolve(name: str) -> set[str]:
    """Every address `name` resolves to (all of a headless Service's ready pods)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return {str(ipaddress.ip_address(info[4][0].split("%", 1)[0])) for info in infos}


class PrefillLegFailedError(Exception):
    """The prefill leg gave no KV to pull; `reason` is one of PREFILL_FALLBACK_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class PrefillViaHeader:
    """The prefill legs a consumer runs on the instances the header names.

    Disabled (the server was started without --prefill-via-header), it ignores the header,
    and says so once in the debug log. `on_fallback` counts each leg that failed, by reason.
    """

    def __init__(
        self,
        enabled: bool,
        cache_salt_header: str | None = None,
        on_fallback: Callable[[str], None] | None = None,
        timeout: httpx.Timeout | None = None,
        allowed: AllowedHosts | None = None,
    ) -> None:
        self.enabled = enabled
        self.allowed = allowed or AllowedHosts([])
        self._refused_hosts: set[str] = set()
        self.cache_salt_header = cache_salt_header
        self.on_fallback = on_fallback
        self.timeout = timeout or PREFILL_TIMEOUT
        self.client: httpx.AsyncClient | None = None
        self._ignored_once = False

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Hold one HTTP client for the app's life (its lifespan); nothing when disabled."""
        if not self.enabled:
            yield
            return
        # As the router's client: internal traffic, so no HTTP(S)_PROXY from the environment;
        # no cap on connections (a pool limit would queue prompts here, invisible to every
        # metric); idle connections dropped well before uvicorn's 5 s keep-alive timeout, so
        # that none the prefill instance is closing is reused and taken for a failed leg. No
        # redirect is followed: it would send the prompt and the client's key where the
        # picker did not point.
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0
        )
        async with httpx.AsyncClient(
            limits=limits, trust_env=False, follow_redirects=False, timeout=self.timeout
        ) as client:
            self.client = client
            try:
                yield
            finally:
                self.client = None

    async def prefill(
        self, path: str, body: SamplingRequest, request: HTTPRequest
    ) -> Response | None:
        """Run the prefill leg the request's header asks for, and point `body` at its KV.

        Returns the prefill instance's answer when it refused the request (4xx: the client's
        error, passed on as it is); otherwise None, and `body` is served here: with the leg's
        kv_transfer_params, or without when the leg failed (the prompt is computed here) or
        when there was none to run (no header; the router ran it; a shape P/D does not serve).
        """
        value = request.headers.get(PREFILLER_HEADER, "").strip()
        if not value:
            return None
        if not self.enabled:
            if not self._ignored_once:
                self._ignored_once = True
                logger.debug(
                    "ignoring the %s header: this server runs no prefill leg without "
                    "--prefill-via-header",
                    PREFILLER_HEADER,
                )
            return None
        address = prefiller_address(value)
        if body.kv_transfer_params:
            return None  # a router ran the prefill leg already
        raw = dict(await request.json())  # the body as the client sent it (FastAPI kept it)
        if not needs_prefill(path, raw):
            return None
        host = address.rsplit(":", 1)[0]
        if not await self.allowed.allows(host):
            # Not a prefill instance of ours: the prompt (and the client's key) stay here.
            if host not in self._refused_hosts and len(self._refused_hosts) < 100:
                self._refused_hosts.add(host)
                logger.warning(
                    "the %s header names %s, not one of --prefill-hosts; computing the prompt here",
                    PREFILLER_HEADER,
                    address,
                )
            if self.on_fallback is not None:
                self.on_fallback("not_allowed")
            return None
        if self.cache_salt_header is not None:
            # The tenant's salt, as the router sends it: the prefill's blocks must be the
            # tenant's, whatever salt the client wrote.
            raw["cache_salt"] = body.cache_salt
        try:
            answer = await cancel_on_disconnect(
                request, self._send(address, path, prefill_body(path, raw), request.headers)
            )
        except PrefillLegFailedError as failure:
            logger.warning(
                "the prefill leg on %s failed (%s); computing the prompt here", address, failure
            )
            if self.on_fallback is not None:
                self.on_fallback(failure.reason)
            return None
        if isinstance(answer, Response):
            return answer
        body.kv_transfer_params = answer
        return None

    async def _send(
        self, address: str, path: str, prefill: dict[str, Any], headers: Mapping[str, str]
    ) -> Response | dict[str, Any]:
        """The prefill's kv_transfer_params, or the response of a 4xx to pass on."""
        if self.client is None:
            raise RuntimeError("the app's lifespan, which holds the prefill client, has not run")
        sent = {"content-type": "application/json"}
        # The same request id on both legs, the client's key, and its tenant (from which an
        # instance with the same --cache-salt-header derives the same salt).
        for name in ("authorization", "x-request-id", self.cache_salt_header):
            if name is not None and name in headers:
                sent[name.lower()] = headers[name]
        try:
            response = await self.client.post(
                f"http://{address}{path}", content=json.dumps(prefill).encode(), headers=sent
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise PrefillLegFailedError("unreachable", f"cannot connect: {error!r}") from None
        except httpx.TimeoutException:
            seconds = self.timeout.read
            raise PrefillLegFailedError("timeout", f"no answer within {seconds} s") from None
        except httpx.TransportError as error:
            raise PrefillLegFailedError(
                "unreachable", f"dropped the connection: {error!r}"
            ) from None
        status = response.status_code
        if 400 <= status < 500:
            relayed = {n: response.headers[n] for n in _RELAYED_HEADERS if n in response.headers}
            return Response(response.content, status, headers=relayed)
        if status >= 500:
            raise PrefillLegFailedError("server_error", f"answered {status}")
        if not response.is_success:
            raise PrefillLegFailedError("bad_response", f"answered {status}")
        return _kv_transfer_params(response)


def _kv_transfer_params(response: httpx.Response) -> dict[str, Any]:
    """A prefill answer's kv_transfer_params, checked as the decode will check them."""
    try:
        answer = response.json()
    except ValueError:
        raise PrefillLegFailedError("bad_response", "answered with no JSON") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params:
        raise PrefillLegFailedError("bad_response", "answered without kv_transfer_params")
    try:
        parsed = parse_kv_transfer_params(params)
    except ValueError as error:
        raise PrefillLegFailedError("bad_response", str(error)) from None
    if not isinstance(parsed, RemotePrefill):
        raise PrefillLegFailedError("bad_response", "answered kv_transfer_params to pull nothing")
    return params
