"""`tidegate bench serve` and `tidegate bench throughput`; imported only when they run."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tidegate.engine.entrypoints.args import add_engine_args, engine_args_from


def _bench_serve(ns: argparse.Namespace) -> int:
    from tidegate.engine.bench.serve import main as bench_serve

    return bench_serve(ns)


def _bench_throughput(ns: argparse.Namespace) -> int:
    from tidegate.engine.bench.throughput import main as bench_throughput

    return bench_throughput(ns, engine_args_from(ns))


def add_bench(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    from tidegate.engine.bench.serve import add_arguments

    bench = parser.add_subparsers(dest="bench", required=True)
    serve = bench.add_parser("serve", help="load an OpenAI-compatible server")
    add_arguments(serve)
    serve.set_defaults(handler=_bench_serve)
    throughput = bench.add_parser("throughput", help="offline throughput through LLM")
    add_engine_args(throughput)
    throughput.add_argument("--input-len", type=int, default=128)
    throughput.add_argument("--output-len", type=int, default=64)
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--out", default=None)
    throughput.set_defaults(handler=_bench_throughput)


COMMANDS: dict[str, Callable[[argparse.ArgumentParser, dict[str, Any] | None], None]] = {
    "bench": add_bench
}
