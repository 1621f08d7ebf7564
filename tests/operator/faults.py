"""Faults for the emulated API server (tests/operator/cluster.py): refused, slow and held
requests, and watch streams that are cut or expire.

A test arms a fault with `cluster.faults.refuse(...)`, `.delay(...)`, `.hold(...)` or
`.cut_watch(...)`; the emulator consults them for every request, before it stores anything, so
a refused or held write changes nothing. Each fault matches requests by method and a regular
expression searched in the path, and only the operator's (a test's own calls through
`EmulatedCluster` are never hit); `token` narrows it to one operator's credentials. `times`
bounds how many requests it hits (None: until `clear()`).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kmock._internal import k8s as kmock_k8s

_REASONS = {409: "Conflict", 500: "InternalError", 503: "ServiceUnavailable"}


def _error(status: int) -> kmock_k8s.KubernetesError:
    """What an armed fault answers with: the API server's Status body with that code."""
    reason = _REASONS.get(status, "Injected")
    return kmock_k8s.KubernetesError(status=status, reason=reason, message=f"injected: {reason}")


@dataclass
class Fault:
    """One armed fault; `hits` counts the requests it has met so far, `hit_at` says when
    (time.monotonic())."""

    method: str | None
    path: re.Pattern[str]
    times: int | None
    token: str | None
    status: int | None = None  # answer with this error
    delay_s: float = 0.0  # or answer this late (and store the write that late)
    held: threading.Event | None = None  # or hold the request until this is set
    watch: str | None = None  # or, on a watch stream: "cut" or "gone" at its next change
    hits: int = 0
    hit_at: list[float] = field(default_factory=list)
    reached: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """Let a held request go on: it is answered 503 and stores nothing (its client is
        presumed gone, as after a kill)."""
        assert self.held is not None, "not a hold"
        self.held.set()


class Faults:
    """The armed faults of one emulated API server; safe to arm from the test's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def refuse(
        self,
        method: str | None,
        path: str,
        status: int,
        *,
        times: int | None = 1,
        token: str | None = None,
    ) -> Fault:
        """Answer matching requests with `status` (409, 500, 503, ...) and store nothing."""
        return self._arm(Fault(method, re.compile(path), times, token, status=status))

    def delay(
        self,
        method: str | None,
        path: str,
        seconds: float,
        *,
        times: int | None = 1,
        token: str | None = None,
    ) -> Fault:
        """Serve matching requests `seconds` late: a write lands then, even if its client has
        stopped waiting for the answer."""
        return self._arm(Fault(method, re.compile(path), times, token, delay_s=seconds))

    def hold(self, method: str | None, path: str, *, token: str | None = None) -> Fault:
        """Hold the first matching request until `release()`; `reached` is set once one is."""
        return self._arm(Fault(method, re.compile(path), 1, token, held=threading.Event()))

    def cut_watch(self, path: str, *, gone: bool = False, times: int | None = 1) -> Fault:
        """End matching watch streams where they would deliver their next change (MODIFIED or
        DELETED), which is lost with them: cut, or first a 410 Gone ERROR event, as the API
        server sends when the stream's resourceVersion is too old."""
        kind = "gone" if gone else "cut"
        return self._arm(Fault("GET", re.compile(path), times, None, watch=kind))

    def clear(self) -> None:
        """Disarm every fault; held requests are released."""
        with self._lock:
            for fault in self._faults:
                if fault.held is not None:
                    fault.held.set()
            self._faults.clear()

    def _arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def _take(self, request: Any, watch: bool) -> Fault | None:
        """The first armed fault that matches `request`, counted as hit."""
        headers = request.headers
        if headers.get("User-Agent", "").startswith("python-httpx"):
            return None  # the test's own calls
        method = str(request.method).upper().split(".")[-1]
        path = str(request.url.path)
        token = headers.get("Authorization", "").removeprefix("Bearer ")
        with self._lock:
            for fault in self._faults:
                if (
                    (fault.watch is not None) == watch
                    and fault.method in (None, method)
                    and fault.path.search(path)
                    and fault.token in (None, token)
                    and (fault.times is None or fault.hits < fault.times)
                ):
                    fault.hits += 1
                    fault.hit_at.append(time.monotonic())
                    fault.reached.set()
                    return fault
        return None

    async def before(self, request: Any) -> None:
        """Act on a request that is not a watch, before the emulator stores anything."""
        fault = self._take(request, watch=False)
        if fault is None:
            return
        if fault.status is not None:
            raise _error(fault.status)
        if fault.held is not None:
            while not fault.held.is_set():
                await asyncio.sleep(0.05)
            raise _error(503)
        await asyncio.sleep(fault.delay_s)

    def on_watch(self, request: Any) -> str | None:
        """The fault ("cut" or "gone") for a watch request an armed fault matches, or None."""
        fault = self._take(request, watch=True)
        return None if fault is None else fault.watch


def gone_event() -> dict[str, Any]:
    """The ERROR event of a watch whose resourceVersion is too old."""
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "reason": "Expired",
            "code": 410,
            "message": "too old resource version",
        },
    }
