"""A real `tidegate serve` process for tests, with its log in a file and its children visible."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from tidegate.common.local_server import LocalServer, free_port, serve_command
from tidegate.operator.render import render

STARTUP_DEADLINE_S = 90.0


class ServerProcess(LocalServer):
    """`tidegate serve --model DIR --dtype float32 ...` on 127.0.0.1."""

    def __init__(
        self, model_dir: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None
    ) -> None:
        port = free_port()
        command = serve_command(model_dir, "--dtype", "float32", *flags, port=port)
        super().__init__(command, port, log=log_dir / f"serve-{port}.log", env=env)

    def wait_healthy(self, deadline_s: float = STARTUP_DEADLINE_S) -> ServerProcess:  # type: ignore[override]
        try:
            super().wait_healthy(deadline_s)
        except RuntimeError as error:
            raise AssertionError(str(error)) from None
        return self

    def children(self) -> dict[str, psutil.Process]:
        """The engine processes under this server, by their process title."""
        found = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                title = " ".join(child.cmdline()).strip()
            except psutil.NoSuchProcess:
                continue
            if title.startswith("tidegate::"):
                found[title] = child
        return found

    def wait_exit(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


def serving(proc: ServerProcess) -> Iterator[ServerProcess]:
    """A server fixture's body (`yield from serving(...)`): the server once healthy; then it is
    stopped, and must have exited 0 on SIGTERM."""
    try:
        yield proc.wait_healthy()
    finally:
        code = proc.stop()
        assert code == 0, f"server exited with {code} after SIGTERM:\n{proc.log()}"


def rendered_config(resource: dict[str, Any], role: str, directory: Path) -> Path:
    """Write the `tidegate serve --config` file the operator renders for one role."""
    config_map = next(o for o in render(resource).objects if o["kind"] == "ConfigMap")
    path = directory / f"{role}.yaml"
    path.write_text(config_map["data"][f"{role}.yaml"])
    return path
