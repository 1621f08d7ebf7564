"""The `tidegate` command: a thin dispatcher, one subcommand per job.

It knows each subcommand's name, one-line help and the module that defines it, and imports
that module only when the subcommand runs. `tidegate --help` imports no part of Tidegate;
`tidegate serve` imports the engine's command module and, when it runs, the API server, but
never the operator or the benchmark client; `tidegate operator` never imports torch. Each
subcommand names the extras of pyproject.toml it needs, and one run without them ends with a
line that says which to install.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class Command(NamedTuple):
    module: str  # defines COMMANDS[name](parser, config), and CONFIG_MODELS if --config applies
    help: str
    extras: tuple[str, ...] = ()  # pyproject's extras it imports beyond the base install


_ENGINE = "tidegate.engine.entrypoints.cli"
_OPERATOR = "tidegate.operator.cli"

COMMANDS: dict[str, Command] = {
    "make-tiny-model": Command(
        _ENGINE, "write a random-weight model folder for tests", ("engine",)
    ),
    "make-tiny-adapter": Command(
        _ENGINE, "write a random LoRA adapter (PEFT folder) for a model folder", ("engine",)
    ),
    "generate": Command(_ENGINE, "generate text offline from prompts", ("engine",)),
    "serve": Command(_ENGINE, "serve the OpenAI-compatible API", ("engine",)),
    "router": Command(
        "tidegate.engine.router.cli",
        "route requests to prefill and decode instances",
        ("engine",),
    ),
    "bench": Command("tidegate.engine.bench.cli", "benchmarks", ("bench", "engine")),
    "fetch-model": Command(_ENGINE, "put a model or adapter folder in place (init containers)"),
    "plan": Command(_OPERATOR, "what the operator would create for a manifest, and why"),
    "up": Command(
        _OPERATOR, "run an LLMDeployment's pods on this machine, as in a cluster", ("engine",)
    ),
    "operator": Command(_OPERATOR, "run the Kubernetes operator (kopf)", ("operator",)),
    "demo": Command(
        _OPERATOR, "run the tiny disaggregated example, ask it one question", ("engine",)
    ),
}


def version() -> str:
    """The installed distribution's version: pyproject.toml's, the one release number that the
    chart's appVersion and the image tags carry too (tests/images checks that they agree)."""
    try:
        return importlib.metadata.version("tidegate")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def build_parser(
    config: dict[str, Any] | None = None, only: Iterable[str] | None = None
) -> argparse.ArgumentParser:
    """The command line; `config` holds `--config` values.

    `only` names the subcommands whose flags are built (their modules are imported); the others
    appear in --help by name. None builds them all, as the tests and the chart checks need.
    """
    selected = set(COMMANDS if only is None else only)
    parser = argparse.ArgumentParser(prog="tidegate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        if name in selected:
            importlib.import_module(command.module).COMMANDS[name](child, config)
    return parser


def _config_values(command: str, argv: Sequence[str]) -> dict[str, Any] | None:
    """The values of `--config FILE` for a command that takes one, read against its models."""
    models = getattr(importlib.import_module(COMMANDS[command].module), "CONFIG_MODELS", {})
    if command not in models:
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if path is None:
        return None
    from tidegate.engine.entrypoints.args import load_config_file

    return load_config_file(path, models[command])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        return _run(command, argv)
    except ModuleNotFoundError as error:
        # A third-party module the command's extra brings; anything else is a real bug.
        missing = (error.name or "").partition(".")[0]
        extras = COMMANDS[command].extras if command else ()
        if not extras or missing in ("", "tidegate") or missing in sys.stdlib_module_names:
            raise
        needs = " and ".join(extras) + (" extra" if len(extras) == 1 else " extras")
        print(
            f"tidegate {command} needs the {needs} (no module named {missing!r}): "
            f"pip install 'tidegate[{','.join(extras)}]'",
            file=sys.stderr,
        )
        return 1


def _run(command: str | None, argv: list[str]) -> int:
    """The subcommand's flags read and its handler run; `main` adds the missing-extra message."""
    config = _config_values(command, argv[1:]) if command else None
    ns = build_parser(config, only=[command] if command else []).parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as error:
        print(f"tidegate: {error}", file=sys.stderr)
        return 2
