"""`tidegate router`: the proxy process, served by uvicorn until SIGTERM or SIGINT.

Exit codes: 0 after a stop signal (in-flight requests drained up to --shutdown-timeout),
1 when it could not start (the port is taken, or start-up failed).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.auth import load_api_keys
from tidegate.engine.http_server import StoppableServer
from tidegate.engine.process import LOG_FORMAT, name_process
from tidegate.engine.router.app import build_app

logger = logging.getLogger("tidegate.router")


def run_router(args: RouterArgs) -> int:
    """Run until stopped; returns the process exit code."""
    name_process("tidegate::router")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.log_level != "debug":
        # httpx logs every upstream request at INFO: two lines per client request.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        api_keys = load_api_keys(args)
    except ValueError as error:
        logger.error("tidegate router could not start: %s", error)
        return 1
    config = uvicorn.Config(
        build_app(args, api_keys),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
        access_log=False,
    )
    server = StoppableServer(config)
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
