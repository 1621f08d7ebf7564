"""`tidegate up`'s supervisor runs a multi-node replica's processes as one unit, as LWS's
RecreateGroupOnPodRestart does: when any of them exits, the others are stopped, and after the
backoff all start again, on a fresh rendezvous port. Small Python processes stand in for the
leader (it answers /health) and the worker (it only runs), so no engine is needed.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tidegate.common.local_server import free_port
from tidegate.operator.up import LocalPod, Supervisor, set_master_port

LEADER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
WORKER = "import time\nwhile True:\n    time.sleep(1)\n"
QUICK_S = 15.0


def group(tmp_path: Path, leader: str = LEADER, worker: str = WORKER) -> list[LocalPod]:
    port = free_port()
    leader_command = [sys.executable, "-c", leader, "--master-port", "0", "--port", str(port)]
    worker_command = [sys.executable, "-c", worker, "--master-port", "0"]
    members = [
        LocalPod("unified", "g-0", leader_command, port, tmp_path / "g-0.log", group="g-0"),
        LocalPod(
            "unified", "g-0-1", worker_command, 0, tmp_path / "g-0-1.log", group="g-0", node_rank=1
        ),
    ]
    set_master_port(members)
    return members


@pytest.fixture
def running(tmp_path: Path) -> Iterator[list[LocalPod]]:
    """A group under a running supervisor; afterwards, nothing of it is left running."""
    pods = group(tmp_path)
    supervisor = Supervisor(pods, startup_timeout_s=QUICK_S)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    try:
        assert supervisor.ready.wait(QUICK_S) and supervisor.error is None, supervisor.error
        yield pods
    finally:
        started = [
            psutil.Process(pod.pid) for pod in pods if pod.pid and psutil.pid_exists(pod.pid)
        ]
        supervisor.stop()
        thread.join(QUICK_S)
        _, alive = psutil.wait_procs(started, timeout=QUICK_S)
        assert not alive, f"left running: {alive}"


def wait_restarted(pods: list[LocalPod], before: dict[str, int]) -> None:
    """Until every pod of the group runs again, each as a new process."""
    deadline = time.monotonic() + QUICK_S
    while time.monotonic() < deadline:
        if all(pod.pid not in (None, before[pod.name]) and pod.exited() is None for pod in pods):
            return
        time.sleep(0.05)  # polling with a deadline
    raise AssertionError(f"not restarted: {[(p.name, p.pid, p.exited()) for p in pods]}")


@pytest.mark.parametrize("victim", ["g-0-1", "g-0"], ids=["worker", "leader"])
def test_one_process_down_restarts_the_whole_group_on_a_fresh_port(
    running: list[LocalPod], victim: str
) -> None:
    pods = running
    before = {pod.name: pod.pid for pod in pods}
    port_before = pods[0].command[pods[0].command.index("--master-port") + 1]
    others = [psutil.Process(pid) for name, pid in before.items() if name != victim]
    psutil.Process(before[victim]).send_signal(signal.SIGKILL)
    # The rest of the group is stopped, not left to run beside a dead member ...
    _, alive = psutil.wait_procs(others, timeout=QUICK_S)
    assert not alive
    # ... and after the backoff every member starts again, meeting on a new port.
    wait_restarted(pods, before)
    assert [pod.restarts for pod in pods] == [1, 1]
    ports = {pod.command[pod.command.index("--master-port") + 1] for pod in pods}
    assert len(ports) == 1 and ports != {port_before}
    assert pods[0].server is not None
    pods[0].server.wait_healthy(QUICK_S)


def test_a_worker_that_cannot_start_is_named(tmp_path: Path) -> None:
    # As the engine's leader, this one is never ready without its worker.
    pods = group(tmp_path, leader=WORKER, worker="import sys\nsys.exit(3)\n")
    supervisor = Supervisor(pods, startup_timeout_s=QUICK_S)
    try:
        supervisor.start()
        assert supervisor.error is not None
        assert supervisor.error.startswith("g-0 did not become ready: g-0-1 exited with code 3")
    finally:
        supervisor.stop()
