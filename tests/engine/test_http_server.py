"""StoppableServer against the uvicorn installed here.

engine/http_server.py overrides `uvicorn.Server.capture_signals`, a method uvicorn does not
document, so that SIGTERM ends serve() and the engine can stop its core before exiting 0. These
tests fail when a uvicorn release renames the method, changes its shape, or stops calling it
from serve(): the cue to revisit the override and the bound on uvicorn in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import uvicorn

from tidegate.common.local_server import free_port
from tidegate.engine.http_server import StoppableServer

# A server on a trivial ASGI app in its own process; prints once serve() has returned.
SERVE_AND_REPORT = """
import asyncio, sys
import uvicorn
from tidegate.engine.http_server import StoppableServer

async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

server_class = {"StoppableServer": StoppableServer, "uvicorn.Server": uvicorn.Server}[sys.argv[2]]
config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), lifespan="off")
asyncio.run(server_class(config).serve())
print("serve() returned", flush=True)
"""


def test_uvicorn_still_has_the_method_stoppable_server_overrides() -> None:
    ours, theirs = StoppableServer.capture_signals, uvicorn.Server.capture_signals
    assert theirs is not ours and "capture_signals" in vars(uvicorn.Server)
    assert inspect.signature(theirs).parameters.keys() == inspect.signature(ours).parameters.keys()
    assert inspect.isgeneratorfunction(inspect.unwrap(theirs)), "no longer a contextmanager"
    server = uvicorn.Server(uvicorn.Config(app=None))
    assert isinstance(uvicorn.Server.capture_signals(server), contextlib.AbstractContextManager)
    # The override installs uvicorn's own handler for the stop signals.
    assert list(inspect.signature(server.handle_exit).parameters) == ["sig", "frame"]


def test_uvicorn_still_has_the_methods_the_drain_extends() -> None:
    # StoppableServer's drain hooks uvicorn's handle_exit (the signal handler) and on_tick
    # (its main loop's check, which decides when serve() stops listening).
    for name, parameters in (("handle_exit", ["sig", "frame"]), ("on_tick", ["counter"])):
        assert name in vars(uvicorn.Server), name
        signature = inspect.signature(getattr(uvicorn.Server, name))
        assert list(signature.parameters)[1:] == parameters, name
    assert inspect.iscoroutinefunction(uvicorn.Server.on_tick)


def wait_until_serving(port: int, process: subprocess.Popen, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1) as response:
                assert response.read() == b"ok"
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)  # polling with a deadline
    raise AssertionError(f"nothing answered on port {port} within {deadline_s:.0f} s")


@pytest.mark.parametrize(
    ("server_class", "returncode", "returned"),
    [
        ("StoppableServer", 0, True),
        # uvicorn's own server re-raises the signal after its shutdown: what the override
        # prevents, and proof that the signal reached a server that was serving.
        ("uvicorn.Server", -signal.SIGTERM, False),
    ],
)
def test_sigterm_ends_serve_and_the_process_exits_0(
    tmp_path: Path, server_class: str, returncode: int, returned: bool
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_AND_REPORT, str(port), server_class],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,  # not the repository root: its operator/ would shadow the stdlib module
    )
    try:
        wait_until_serving(port, process)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == returncode, stderr
    assert ("serve() returned" in stdout) is returned, stdout + stderr
    assert "Shutting down" in stderr  # uvicorn's graceful shutdown ran in both cases


# A draining server whose one request never ends: "/" answers ok, "/hang" hangs.
DRAIN_A_HANGING_REQUEST = """
import asyncio, logging, sys
import uvicorn
from tidegate.engine.entrypoints.openai.drain import DrainMiddleware
from tidegate.engine.http_server import Drain, StoppableServer

async def app(scope, receive, send):
    if scope["path"] == "/hang":
        print("hanging", flush=True)
        await asyncio.Event().wait()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

logging.basicConfig(level="INFO")
drain = Drain(timeout_s=float(sys.argv[2]))
config = uvicorn.Config(
    DrainMiddleware(app, drain), host="127.0.0.1", port=int(sys.argv[1]), lifespan="off"
)
asyncio.run(StoppableServer(config, drain).serve())
"""


def test_a_drain_that_runs_out_of_time_stops_within_the_shutdown_timeout(tmp_path: Path) -> None:
    port, timeout_s = free_port(), 1.5
    process = subprocess.Popen(
        [sys.executable, "-c", DRAIN_A_HANGING_REQUEST, str(port), str(timeout_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        wait_until_serving(port, process)
        # A request in flight through the drain, once the app says it has it.
        hanging = socket.create_connection(("127.0.0.1", port))
        hanging.sendall(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        assert process.stdout is not None
        while (line := process.stdout.readline()) != "hanging\n":
            assert line, "the server exited before it had the request"  # else access logs
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
        assert refused.value.code == 503  # still listening, and refusing
        _, stderr = process.communicate(timeout=30)
        stopped_s = time.monotonic() - signalled
        hanging.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "drain timed out with 1 requests in flight" in stderr
    assert timeout_s - 0.5 < stopped_s < timeout_s + 2.0, stopped_s
