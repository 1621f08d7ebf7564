"""A real `tidegate serve` process for tests: start, wait until healthy, stop, inspect."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

TIDEGATE = str(Path(sys.executable).parent / "tidegate")
STARTUP_DEADLINE_S = 90.0


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`tidegate serve --model DIR ...` on 127.0.0.1, with its log in a file."""

    def __init__(self, model_dir: Path, log_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        command = [TIDEGATE, "serve", "--model", str(model_dir), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--dtype", "float32", *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = self.log_path.open("w")
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.startup_seconds: float | None = None

    def wait_healthy(self, deadline_s: float = STARTUP_DEADLINE_S) -> ServerProcess:
        """Poll /health until it answers 200; fail with the server's log otherwise."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    self.startup_seconds = time.monotonic() - self.started_at
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not healthy after {deadline_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

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

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL for the whole session if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode
