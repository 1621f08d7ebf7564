"""free_port: a port handed out stays reserved against other starts on this machine, so two
servers started at once are never given the same one. wait_healthy: a health check answered
by a process outside the started server's tree is an error, not a healthy server."""

from __future__ import annotations

import http.server
import multiprocessing
import socket
import sys
import threading
import time
from typing import ClassVar

import pytest

from tidegate.common import local_server


class FakeSocket:
    """socket.socket whose bind(0) lands on the next port of a script."""

    script: ClassVar[list[int]] = []

    def __enter__(self) -> FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = FakeSocket.script.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    path = tmp_path / "ports"
    monkeypatch.setattr(local_server, "PORT_REGISTRY", path)
    return path


def test_a_port_handed_out_is_not_handed_out_again_while_reserved(registry, monkeypatch):
    monkeypatch.setattr(local_server.socket, "socket", FakeSocket)
    # The kernel offers 40001 twice (the first server has not bound it yet): the second
    # caller gets the next port it offers instead.
    FakeSocket.script = [40001, 40001, 40001, 40002]
    assert local_server.free_port() == 40001
    assert local_server.free_port() == 40002
    assert sorted(int(line.split()[0]) for line in registry.read_text().splitlines()) == [
        40001,
        40002,
    ]


def test_a_reservation_expires(registry, monkeypatch):
    monkeypatch.setattr(local_server.socket, "socket", FakeSocket)
    registry.write_text("40001 1000.0\n40002 garbage\n")  # long expired, and a broken line
    FakeSocket.script = [40001]
    assert local_server.free_port() == 40001
    (line,) = registry.read_text().splitlines()
    assert line.startswith("40001 ") and float(line.split()[1]) > 1000.0


def test_consecutive_ports_are_free_and_reserved_together(registry, monkeypatch):
    # The first port offered has a reserved neighbour, the second a neighbour someone
    # listens on: the third run of two is the one, and both of its ports are reserved.
    registry.write_text(f"40001 {time.time()}\n")
    monkeypatch.setattr(local_server.socket, "socket", FakeSocket)
    monkeypatch.setattr(local_server, "_bindable", lambda port: port != 40021)
    FakeSocket.script = [40000, 40020, 40010]
    assert local_server.free_port(consecutive=2) == 40010
    reserved = {int(line.split()[0]) for line in registry.read_text().splitlines()}
    assert reserved == {40001, 40010, 40011}


def test_a_run_of_ports_past_the_last_port_is_not_offered():
    assert not local_server._bindable(65536)


def test_without_a_registry_it_still_gives_a_free_port(tmp_path, monkeypatch):
    monkeypatch.setattr(local_server, "PORT_REGISTRY", tmp_path / "missing" / "ports")
    port = local_server.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free


def _ports(count: int, path: str, queue) -> None:
    local_server.PORT_REGISTRY = type(local_server.PORT_REGISTRY)(path)
    queue.put([local_server.free_port() for _ in range(count)])


def test_processes_asking_at_once_get_distinct_ports(registry):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_ports, args=(200, str(registry), queue)) for _ in range(3)]
    for worker in workers:
        worker.start()
    ports = [port for _ in workers for port in queue.get(timeout=60)]
    for worker in workers:
        worker.join(timeout=60)
    assert len(ports) == 600 and len(set(ports)) == 600


HTTP_SERVER = (
    "import http.server, sys; http.server.test(http.server.SimpleHTTPRequestHandler,"
    " port=int(sys.argv[1]), bind='127.0.0.1')"
)


def test_a_server_listening_itself_or_through_a_child_is_healthy(tmp_path):
    port = local_server.free_port()
    command = [sys.executable, "-c", HTTP_SERVER, str(port)]
    with local_server.LocalServer(command, port, log=tmp_path / "a.log", cwd=tmp_path) as server:
        server.wait_healthy(deadline_s=60, path="/")
    # The listener a grandchild: a shell, then the server.
    port = local_server.free_port()
    command = ["sh", "-c", f'{sys.executable} -c "{HTTP_SERVER}" {port}; true']
    with local_server.LocalServer(command, port, log=tmp_path / "b.log", cwd=tmp_path) as server:
        server.wait_healthy(deadline_s=60, path="/")
        assert len(local_server.process_tree(server.process.pid)) >= 2


def test_a_health_check_answered_by_another_process_is_an_error(tmp_path):
    # What a port race looks like: the started server never listens (here it just sleeps;
    # really it lost the bind), and a server outside its tree answers on its port.
    foreign = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=foreign.serve_forever, daemon=True)
    thread.start()
    port = foreign.server_address[1]
    try:
        server = local_server.LocalServer(["sleep", "60"], port, log=tmp_path / "log")
        with server, pytest.raises(RuntimeError, match=f"port {port} is held by a process outside"):
            server.wait_healthy(deadline_s=30, path="/")
    finally:
        foreign.shutdown()
        foreign.server_close()


def test_listening_sockets_are_read_from_proc_net(tmp_path):
    net = tmp_path / "net"
    net.mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (net / "tcp").write_text(
        header
        + "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1\n"
        # the same port, a connection (not listening): not the listener
        + "   1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000  1000        0 222 1\n"
        + "   2: 00000000:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 333 1\n"
    )
    (net / "tcp6").write_text(
        header
        + "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000  1000        0 444 1\n"
    )
    assert local_server.listening_socket_inodes(8080, tmp_path) == {"111", "444"}
    assert local_server.listening_socket_inodes(8082, tmp_path) == set()
    assert local_server.listening_socket_inodes(8080, tmp_path / "absent") == set()


def test_the_process_tree_follows_parents_in_proc(tmp_path):
    for pid, ppid, comm in [(10, 1, "a"), (11, 10, "b (x) y"), (12, 11, "c"), (13, 1, "d")]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 0 0\n")
    (tmp_path / "self").mkdir()
    assert local_server.process_tree(10, tmp_path) == {10, 11, 12}
    assert local_server.process_tree(13, tmp_path) == {13}
    fd = tmp_path / "12" / "fd"
    fd.mkdir()
    (fd / "3").symlink_to("socket:[555]")
    (fd / "4").symlink_to("/dev/null")
    assert local_server.socket_inodes(12, tmp_path) == {"555"}
    assert local_server.socket_inodes(99, tmp_path) == set()
