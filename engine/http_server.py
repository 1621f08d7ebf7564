"""The HTTP server under `tidegate serve` and `tidegate router`: uvicorn that stops on request.

A low module of its own (it imports no other Tidegate module), so that the router and the API
server share it without one importing the other.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# On a draining server's 503s: the request was refused before anything ran, so a router may
# hold it for another instance (engine/router/pending.py) rather than fail it.
DRAINING_HEADER = "x-tidegate-draining"

logger = logging.getLogger("tidegate.serve")


class Drain:
    """What a server does between a stop signal and closing its port.

    From the signal on, `draining` is true: the app answers /health 503 (readiness probes
    and routers stop sending) and refuses new requests, while the `in_flight` ones (counted
    by the app) finish. The server keeps listening until none is left or `timeout_s` has
    passed, so that the 503s reach whoever asks instead of a refused connection.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.draining = False
        self._deadline = 0.0

    def begin(self) -> None:
        """Start draining (a stop signal came)."""
        self.draining = True
        self._deadline = time.monotonic() + self.timeout_s

    def remaining_s(self) -> float:
        """Seconds of the drain's budget left."""
        return max(0.0, self._deadline - time.monotonic())

    def done(self) -> bool:
        """Whether the server may stop listening: drained, or out of time."""
        return self.draining and (self.in_flight == 0 or self.remaining_s() == 0)


class StoppableServer(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends serve() instead of killing us.

    uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would kill the
    process before the engine core is stopped and turn a clean drain into exit code 143.
    This overrides `uvicorn.Server.capture_signals`, a method uvicorn does not document:
    pyproject bounds uvicorn's version, and tests/engine/test_http_server.py fails if the
    method disappears or a stop signal stops ending serve() cleanly.

    With a `drain`, the first stop signal starts it and the server stops once it is done
    (checked by uvicorn's `on_tick`, ten times a second); a second signal stops it at once.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain | None = None) -> None:
        super().__init__(config)
        self.drain = drain

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain is None or self.drain.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.drain.begin()
        # A signal handler: only the flag changes here; on_tick does the rest.
        logger.info("%s: draining for up to %g s", signal.Signals(sig).name, self.drain.timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain is None or not self.drain.done():
            return False
        # uvicorn's own graceful shutdown (closing connections) gets what is left of the
        # budget, so that the whole stop stays within it.
        self.config.timeout_graceful_shutdown = self.drain.remaining_s()  # type: ignore[assignment]
        if self.drain.in_flight:
            logger.warning("drain timed out with %d requests in flight", self.drain.in_flight)
        self.should_exit = True
        return True
