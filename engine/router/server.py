"""`tidegate router`: the proxy process, served by uvicorn until SIGTERM or SIGINT.

Exit codes: 0 after a stop signal (in-flight requests drained up to --shutdown-timeout),
1 when it could not start (the port is taken, or start-up failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from tidegate.engine.config import RouterArgs
from tidegate.engine.process import LOG_FORMAT, name_process
from tidegate.engine.router.app import build_app

logger = logging.getLogger("tidegate.router")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends serve() with exit code 0.

    uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would turn a
    clean stop into exit code 143.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_router(args: RouterArgs) -> int:
    """Run until stopped; returns the process exit code."""
    name_process("tidegate::router")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.log_level != "debug":
        # httpx logs every upstream request at INFO: two lines per client request.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    config = uvicorn.Config(
        build_app(args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
        access_log=False,
    )
    server = _Server(config)
    logger.info(
        "routing to prefill %s and decode %s on http://%s:%d",
        " ".join(args.prefill),
        " ".join(args.decode),
        args.host,
        args.port,
    )
    asyncio.run(server.serve())
    # uvicorn logs why when it could not bind the port or its lifespan start-up failed.
    return 0 if server.started else 1
