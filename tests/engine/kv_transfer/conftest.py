"""What the KV-transfer tests share: the PULL socket a worker reports its transfers to."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def events() -> Iterator[tuple[str, zmq.Socket]]:
    ctx = zmq.Context.instance()
    address = f"ipc://@test-kv-events-{uuid.uuid4().hex}"
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    yield address, sock
    sock.close(linger=0)
