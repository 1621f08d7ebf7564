"""`tidegate up`'s supervisor and a pod turned on again while it drains (the next canary
revision on the canary pod, started before the last one's requests finished): the old
process ending is the drain's end, not a crash to restart after a backoff, and the pod starts
anew once it is over. Small Python processes stand in for the engine."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import pytest

from tidegate.common.local_server import free_port
from tidegate.operator.up import LocalPod, Supervisor

# Answers /health; on SIGTERM it takes a second to drain, then exits 0 as the engine does.
SERVER = """
import http.server, os, signal, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
def drain(*_):
    time.sleep(1.0)
    os._exit(0)
signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=drain).start())
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    time.sleep(0.1)
"""
QUICK_S = 15.0


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + QUICK_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)  # polling with a deadline
    raise AssertionError(f"not within {QUICK_S} s: {what}")


def test_a_pod_turned_on_while_it_drains_starts_after_the_drain_not_as_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    command = [sys.executable, "-c", SERVER, "--port", str(port)]
    pod = LocalPod("unified", "p-0", command, port, tmp_path / "p-0.log")
    supervisor = Supervisor([pod], startup_timeout_s=QUICK_S)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    caplog.set_level(logging.INFO, logger="tidegate.up")
    try:
        assert supervisor.ready.wait(QUICK_S) and supervisor.error is None, supervisor.error
        first = pod.pid
        pod.active = False
        wait_for(lambda: pod.draining is not None, "the drain starts")
        pod.active = True  # turned on again while the old process still drains
        wait_for(lambda: pod.pid not in (None, first) and pod.exited() is None, "a new start")
        assert pod.server is not None
        pod.server.wait_healthy(QUICK_S)
        assert pod.restarts == 0 and pod.restart_at is None
        assert "exited with code" not in caplog.text
        assert "p-0 started" in caplog.text
    finally:
        supervisor.stop()
        thread.join(QUICK_S)
