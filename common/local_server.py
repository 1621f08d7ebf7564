"""A server process on 127.0.0.1 for demos, benchmarks and tests: start, wait healthy, stop."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

# Ports free_port handed out lately, by any process of this user on this machine: one line
# "port unix-time" each, under an exclusive lock.
PORT_REGISTRY = Path(tempfile.gettempdir()) / f"tidegate-ports-{os.getuid()}"
# How long a port handed out stays reserved: longer than any server takes to bind its port.
PORT_RESERVATION_S = 600.0


def free_port(consecutive: int = 1) -> int:
    """A port nobody listens on right now, and that no free_port call on this machine has
    handed out in the last ten minutes; with `consecutive` > 1, the first of that many
    ports in a row that all are (a rendezvous and the control channel next to it).

    The port is free when the caller gets it; the server it is meant for binds it seconds
    later. Without the reservation, another process starting a server meanwhile (pytest's
    other worker, a second `tidegate up`) was now and then given the same port: the second
    server failed to bind, and its caller's health checks were answered by the first (a CI
    run's router sent every decode leg to another test's producer).
    """
    with _port_registry() as handed_out:
        for _ in range(64):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            ports = range(port, port + consecutive)
            if not any(p in handed_out for p in ports) and all(map(_bindable, ports[1:])):
                break
        now = time.time()
        for reserved in ports:
            handed_out[reserved] = now
        return port


def _bindable(port: int) -> bool:
    """Whether a socket can bind `port` on 127.0.0.1 now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except (OSError, OverflowError):  # taken, or past 65535
            return False
    return True


@contextlib.contextmanager
def _port_registry():
    """The reserved ports (port -> when), locked; written back, less expired ones, on exit.
    Where the file cannot be opened (a read-only /tmp), no reservation: a port free now."""
    try:
        registry = open(PORT_REGISTRY, "a+")  # noqa: SIM115 (closed below)
    except OSError:
        yield {}
        return
    with registry:
        fcntl.flock(registry, fcntl.LOCK_EX)
        registry.seek(0)
        now, handed_out = time.time(), {}
        for line in registry.read().splitlines():
            with contextlib.suppress(ValueError):
                port, when = line.split()
                if now - float(when) < PORT_RESERVATION_S:
                    handed_out[int(port)] = float(when)
        yield handed_out
        registry.seek(0)
        registry.truncate()
        registry.write("".join(f"{port} {when}\n" for port, when in handed_out.items()))


def listening_socket_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """Inodes of the TCP sockets (v4 and v6) listening on `port` on any local address; empty
    where /proc/net does not say (not Linux)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st ... inode: "0: 0100007F:1F90 00000000:0000 0A ..."
            fields = line.split()
            listening = len(fields) > 9 and fields[3] == "0A"  # TCP_LISTEN
            if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[str]:
    """Inodes of the sockets process `pid` holds open (empty if it is gone or not ours)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link.endswith("]"):
                    inodes.add(link[len("socket:[") : -1])
    return inodes


def process_tree(root: int, proc: Path = Path("/proc")) -> set[int]:
    """`root` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def tidegate_command() -> list[str]:
    """How to run `tidegate` from this interpreter's environment."""
    script = Path(sys.executable).parent / "tidegate"
    if script.exists():
        return [str(script)]
    found = shutil.which("tidegate")
    return [found] if found else [sys.executable, "-m", "tidegate.cli"]


def serve_command(model: str | Path, *flags: str, port: int) -> list[str]:
    """`tidegate serve --model MODEL --host 127.0.0.1 --port PORT FLAGS...`."""
    command = [*tidegate_command(), "serve", "--model", str(model), "--host", "127.0.0.1"]
    return [*command, "--port", str(port), *flags]


def router_command(prefill: list[str], decode: list[str], *flags: str, port: int) -> list[str]:
    """`tidegate router --prefill URLS --decode URLS --host 127.0.0.1 --port PORT FLAGS...`.

    With no prefill URLs there is no --prefill flag (it takes one URL or more): a balancer.
    """
    command = [*tidegate_command(), "router", *(["--prefill", *prefill] if prefill else [])]
    command += ["--decode", *decode]
    return [*command, "--host", "127.0.0.1", "--port", str(port), *flags]


class LocalServer:
    """One server process (its own session, so a stray signal cannot reach the caller)."""

    def __init__(
        self,
        command: list[str],
        port: int,
        log: IO | Path | None = None,
        env: dict[str, str] | None = None,
        own_session: bool = True,
        cwd: Path | None = None,
    ) -> None:
        self.command = command
        self.port = port
        self.own_session = own_session
        self.base_url = f"http://127.0.0.1:{port}"
        self._log_file = log.open("w") if isinstance(log, Path) else None
        self.log_path = log if isinstance(log, Path) else None
        output = self._log_file or log
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=own_session,
            cwd=cwd,
        )
        self.startup_seconds: float | None = None

    @classmethod
    def tidegate_serve(
        cls, model: str | Path, *flags: str, log: IO | Path | None = None, port: int | None = None
    ) -> LocalServer:
        """A `tidegate serve` of `model` with these flags (on a free port unless given)."""
        port = port or free_port()
        return cls(serve_command(model, *flags, port=port), port, log=log)

    @classmethod
    def tidegate_router(
        cls,
        prefill: list[str],
        decode: list[str],
        *flags: str,
        log: IO | Path | None = None,
        port: int | None = None,
    ) -> LocalServer:
        """A `tidegate router` in front of these instances (on a free port unless given)."""
        port = port or free_port()
        return cls(router_command(prefill, decode, *flags, port=port), port, log=log)

    def log(self) -> str:
        """What the server printed so far (when it logs to a file)."""
        if self._log_file is None or self.log_path is None:
            return ""
        self._log_file.flush()
        return self.log_path.read_text()

    def wait_healthy(self, deadline_s: float = 300.0, path: str = "/health") -> LocalServer:
        """Poll until `path` answers 200; raise with the log if it exits or the deadline passes."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.command[0]} exited with code {self.process.returncode}\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + path, timeout=1) as response:
                    if response.status == 200:
                        self._check_listener_is_ours()
                        self.startup_seconds = time.monotonic() - self.started_at
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)  # polling with a deadline
        raise RuntimeError(f"not healthy within {deadline_s:.0f} s\n{self.log()}")

    def _check_listener_is_ours(self) -> None:
        """Raise if what answered on the port is not this server: a process outside its
        process tree listens there (a port taken by a tool that picks its own, between
        free_port and this server's bind, which then failed or is still retrying)."""
        inodes = listening_socket_inodes(self.port)
        if not inodes:  # no /proc to ask (not Linux), or the listener closed since: no verdict
            return
        tree = process_tree(self.process.pid)
        if any(socket_inodes(pid) & inodes for pid in tree):
            return
        raise RuntimeError(
            f"port {self.port} is held by a process outside {self.command[0]}'s process tree "
            f"(pids {sorted(tree)}): its health check was answered by another server\n"
            f"{self.log()}"
        )

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains), then SIGKILL of its whole session if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if self.own_session:
            # Whatever the server left behind in its session (a peer's worker processes that
            # outlive their parent) would steal CPU from the next measurement.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
        return self.process.returncode

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
