"""`tidegate router`: its flags, from RouterArgs; imported only when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.args import add_engine_args, engine_args_from


def _router(ns: argparse.Namespace) -> int:
    from tidegate.engine.router.server import run_router

    return run_router(engine_args_from(ns, RouterArgs))


def add_router(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flag: value (e.g. prefill: [URL]); flags given here win",
    )
    add_engine_args(parser, RouterArgs, defaults=config)
    parser.set_defaults(handler=_router)


COMMANDS: dict[str, Callable[[argparse.ArgumentParser, dict[str, Any] | None], None]] = {
    "router": add_router
}
CONFIG_MODELS = {"router": [RouterArgs]}
