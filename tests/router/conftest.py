"""A router in front of fake prefill and decode engines, all on real sockets."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.router.fake_engine import FakeEngine, ServerThread
from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.auth import load_api_keys
from tidegate.engine.router.app import build_app


@dataclass
class Backend:
    """A fake engine and the server it runs in (which a test may stop and start again)."""

    engine: FakeEngine
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        self.server.stop()

    def revive(self) -> None:
        old = self.server
        self.server = ServerThread(self.engine.app(), port=old.port, host=old.host).start()


@pytest.fixture
def backend() -> Iterator[Callable[..., Backend]]:
    """Start a fake engine: backend("prefill", name="p0", host=..., port=..., **script)."""
    started: list[Backend] = []

    def start(
        role: str,
        name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        **script: Any,
    ) -> Backend:
        engine = FakeEngine(role, name or f"{role}{len(started)}", **script)
        server = ServerThread(engine.app(), port=port, host=host).start()
        started.append(Backend(engine, server))
        return started[-1]

    yield start
    for each in started:
        each.server.request_stop()
    for each in started:
        each.server.join()


@dataclass
class Router:
    """A running router and a client for it."""

    server: ServerThread
    client: httpx.Client

    def metrics(self) -> str:
        return self.client.get("/metrics").text


def wait_until(condition: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll until `condition()` is true; fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or condition}")
        time.sleep(0.02)


@pytest.fixture
def router() -> Iterator[Callable[..., Router]]:
    """Start a router: router([prefill urls], [decode urls], health_interval=...)."""
    started: list[Router] = []

    def start(prefill: list[str], decode: list[str], **flags: Any) -> Router:
        flags.setdefault("health_interval", 0.2)
        args = RouterArgs(prefill=prefill, decode=decode, host="127.0.0.1", **flags)
        api_keys = load_api_keys(args, environ={})
        server = ServerThread(build_app(args, api_keys), lifespan="on").start()
        client = httpx.Client(base_url=server.url, timeout=10.0)
        started.append(Router(server, client))
        return started[-1]

    yield start
    for each in started:
        each.client.close()
        each.server.stop(force=False)  # the lifespan closes the router's client


@pytest.fixture
def pd(backend, router) -> tuple[Backend, Backend, Router]:
    """One prefill engine, one decode engine, and a router in front of them."""
    prefill, decode = backend("prefill"), backend("decode")
    return prefill, decode, router([prefill.url], [decode.url])
