"""`tidegate up -f examples/autoscaling-tiny.yaml` with real processes: 0 -> 1 -> N -> 0.

One run of up, in four phases, with the example's windows shortened so that the test takes
seconds: the first request at zero waits for a replica and succeeds; load turns a second
replica on; a scale-down while a long stream runs cuts no stream; idle turns the pool off and
its processes end. No request may fail in any phase.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.e2e.test_up import NAME, descendants, stop_and_check_nothing_is_left, up, wait_serving
from tidegate.common.local_server import LocalServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "autoscaling-tiny.yaml"
DEADLINE_S = 120.0
# As long as the tiny model's context allows: the streams must outlast a decision or two.
LONG_STREAM_TOKENS = 4000
PER_REPLICA = 4
IDLE_BEFORE_ZERO_S = 6


def _example(tmp_path: Path) -> Path:
    """The example with two replicas at most and windows of seconds."""
    resource = yaml.safe_load(EXAMPLE.read_text())
    policy = resource["spec"]["autoscaling"]["unified"]
    policy["maxReplicas"] = 2
    policy["idleBeforeZeroSeconds"] = IDLE_BEFORE_ZERO_S
    policy["targets"]["requestsPerReplica"] = PER_REPLICA
    policy["scaleDown"] = {"stabilizationWindowSeconds": 0, "periodSeconds": 1, "pods": 1}
    path = tmp_path / "autoscaling.yaml"
    path.write_text(yaml.safe_dump(resource))
    return path


def _engines(server: LocalServer) -> list[psutil.Process]:
    """The engine pods' API servers that run now."""
    found = []
    for process in descendants(server):
        try:
            if process.cmdline()[0].startswith("tidegate::api"):
                found.append(process)
        except (psutil.Error, IndexError):
            continue
    return found


def _scaled(server: LocalServer) -> list[tuple[int, int]]:
    """The autoscaler's changes so far, from up's log."""
    return [
        (int(a), int(b)) for a, b in re.findall(r"autoscaler: unified (\d+) -> (\d+)", server.log())
    ]


def _replica_url(server: LocalServer, index: int) -> str:
    """Replica `index`'s address, from the table up prints at start (every possible replica)."""
    found = re.search(rf"unified\s+\S+-{index}\s+\S+\s+(http://\S+)", server.log())
    assert found, server.log()
    return found.group(1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(condition, server: LocalServer, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, f"no {what}:\n{server.log()}"
        time.sleep(0.2)  # polling with a deadline


def _stream(base_url: str, max_tokens: int) -> tuple[int, str | None]:
    """A streamed completion: its token count and finish reason (raises on any failure)."""
    body = {
        "model": NAME,
        "prompt": "The tide",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, reason = 0, None
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = httpx.Response(200, content=line[6:]).json()
            for choice in event.get("choices", []):
                reason = choice.get("finish_reason") or reason
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return tokens, reason


@pytest.fixture(scope="module")
def autoscaled(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    folder = tmp_path_factory.mktemp("autoscaled")
    server = up(_example(folder), tiny_llama_dir, folder)
    try:
        wait_serving(server)
        yield server
    finally:
        stop_and_check_nothing_is_left(server)


def test_a_pool_goes_from_zero_to_one_to_two_and_back_to_zero_losing_nothing(
    autoscaled: LocalServer,
) -> None:
    server = autoscaled
    # It starts at zero: the router serves alone.
    assert _engines(server) == [] and _scaled(server) == []

    # Zero -> one: the first request is held by the router until a replica is ready.
    started = time.monotonic()
    assert _stream(server.base_url, 8) == (8, "length")
    cold_start_s = time.monotonic() - started
    assert _scaled(server)[0] == (0, 1), server.log()
    assert len(_engines(server)) == 1

    # One -> two under load: twice the requests one replica carries.
    failures: list[BaseException] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            try:
                assert _stream(server.base_url, 64) == (64, "length")
            except BaseException as error:  # every failure is reported
                failures.append(error)
                return

    clients = [threading.Thread(target=client) for _ in range(2 * PER_REPLICA)]
    for thread in clients:
        thread.start()
    try:
        _wait(lambda: (1, 2) in _scaled(server), server, "scale-up to 2")
        _wait(lambda: len(_engines(server)) == 2, server, "second replica")
        # Ready, not only started: on a loaded machine a replica's start took 27 s, and long
        # streams begun before then all went to the first one and ended before the drain.
        _wait(lambda: _healthy(_replica_url(server, 1)), server, "second replica ready")
        # One replica's worth of long streams, spread over both, then the load stops: the
        # pool shrinks to one while they run, and the replica turned off drains its own.
        long: list[tuple[int, str | None]] = []

        def long_stream() -> None:
            try:
                long.append(_stream(server.base_url, LONG_STREAM_TOKENS))
            except BaseException as error:  # every failure is reported
                failures.append(error)

        streams = [threading.Thread(target=long_stream) for _ in range(PER_REPLICA)]
        for stream in streams:
            stream.start()
    finally:
        done.set()
        for thread in clients:
            thread.join(DEADLINE_S)
    assert not failures, failures
    # Seen while the streams run: the scale-down overlapped them, or the test proves nothing.
    overlapped: list[bool] = []

    def shrunk() -> bool:
        alive = any(stream.is_alive() for stream in streams)
        if (2, 1) in _scaled(server):
            overlapped.append(alive)
            return True
        return not alive

    _wait(shrunk, server, "scale-down to 1")
    assert overlapped == [True], f"the streams ended before the scale-down:\n{server.log()}"
    for stream in streams:
        stream.join(DEADLINE_S)
    assert not failures, failures
    assert long == [(LONG_STREAM_TOKENS, "length")] * PER_REPLICA  # none cut by the drain

    # Idle: to zero after idleBeforeZeroSeconds, and the processes end.
    idle_from = time.monotonic()
    _wait(lambda: (1, 0) in _scaled(server), server, "scale to zero")
    assert time.monotonic() - idle_from >= IDLE_BEFORE_ZERO_S - 1
    _wait(lambda: _engines(server) == [], server, "engine processes to end")
    changes = _scaled(server)
    assert changes[0] == (0, 1) and changes[-1] == (1, 0), server.log()
    assert max(after for _, after in changes) == 2
    print(f"first request at zero took {cold_start_s:.1f} s")
