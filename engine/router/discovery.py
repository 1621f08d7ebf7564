"""Instances behind a URL: a Kubernetes headless Service resolves to one address per pod."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger("tidegate.router")


async def expand_url(url: str, keep_single_name: bool = True) -> list[str]:
    """One URL per IPv4 address the URL's host resolves to; the URL itself for a single one.

    With `keep_single_name` False a single address replaces the name too: an endpoint
    picker hands the gateway `ip:port` endpoints, never names (a one-pod headless Service).
    Raises OSError (socket.gaierror) when the name does not resolve.
    """
    parts = urlsplit(url)
    host = parts.hostname
    if host is None or _is_ip_literal(host):
        return [url]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    addresses = sorted({info[4][0] for info in infos}, key=ipaddress.ip_address)
    if len(addresses) == 0 or (len(addresses) == 1 and keep_single_name):
        # Keep the name: the instance stays reachable if its address changes, and the Host
        # header (and TLS, if any) stay what the operator wrote.
        return [url]
    netloc = f"{{}}:{parts.port}" if parts.port else "{}"
    return [urlunsplit(parts._replace(netloc=netloc.format(address))) for address in addresses]


async def discover(
    seeds: Sequence[str], previous: dict[str, list[str]], keep_single_name: bool = True
) -> dict[str, list[str]]:
    """Expand every seed URL; one that fails to resolve keeps what it expanded to before."""
    results = await asyncio.gather(
        *(expand_url(seed, keep_single_name) for seed in seeds), return_exceptions=True
    )
    expanded: dict[str, list[str]] = {}
    for seed, result in zip(seeds, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, OSError):
                raise result
            # A DNS hiccup must not empty the pool; before the first success the URL itself
            # stands in, so its health check reports the failure.
            expanded[seed] = previous.get(seed, [seed])
            logger.warning("cannot resolve %s (%s); keeping %s", seed, result, expanded[seed])
        else:
            expanded[seed] = result
    return expanded


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
