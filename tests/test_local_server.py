"""free_port: a port handed out stays reserved against other starts on this machine, so two
servers started at once are never given the same one."""

from __future__ import annotations

import multiprocessing
import socket
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
