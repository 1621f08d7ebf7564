"""The HTTP server under `tidegate serve` and `tidegate router`: uvicorn that stops on request.

A low module of its own (it imports no other Tidegate module), so that the router and the API
server share it without one importing the other.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StoppableServer(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends serve() instead of killing us.

    uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would kill the
    process before the engine core is stopped and turn a clean drain into exit code 143.
    This overrides `uvicorn.Server.capture_signals`, a method uvicorn does not document:
    pyproject bounds uvicorn's version, and tests/engine/test_http_server.py fails if the
    method disappears or a stop signal stops ending serve() cleanly.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
