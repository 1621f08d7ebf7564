"""What both sides of the ZMQ transport need: TCP binding and addressing, and a wake-up pipe."""

from __future__ import annotations

import contextlib
import threading
import uuid

import zmq

# Sent through a Waker: the socket thread ends.
STOP = b"stop"


class Waker:
    """An inproc PAIR pipe that wakes a thread polling `receiver`; sending never blocks.

    Only that thread reads (and finally closes) `receiver`; any thread may call `wake`.
    """

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        address = f"inproc://{name}-{uuid.uuid4().hex[:12]}"
        self.receiver = ctx.socket(zmq.PAIR)
        self.receiver.bind(address)
        self._sender = ctx.socket(zmq.PAIR)
        self._sender.connect(address)
        self._lock = threading.Lock()

    def wake(self, message: bytes = b"") -> None:
        """Send `message`; dropped if the pipe is full (it already holds a wake-up)."""
        with self._lock, contextlib.suppress(zmq.Again, zmq.ZMQError):
            self._sender.send(message, zmq.NOBLOCK)

    def close(self) -> None:
        """Close the sending end (the thread closes `receiver`)."""
        with self._lock:
            self._sender.close(linger=0)


def bind_tcp(sock: zmq.Socket, port: int) -> int:
    """Bind on every interface, to `port` or (0) a free one; the port bound."""
    if port:
        try:
            sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as error:
            raise ValueError(f"KV transfer port {port} is not free: {error}") from None
        return port
    return sock.bind_to_random_port("tcp://*")


def tcp_address(host: str, port: int) -> str:
    """tcp://host:port, with an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"
