"""`tidegate up` on a replica over two "nodes" (examples/multinode-tiny.yaml: the tiny model on
CPU, two pipeline stages, one per node): the leader and its worker run as two processes that
meet over TCP as the pods of a LeaderWorkerSet group would.

What a user would notice: the answers are the tokens one process gives (greedy, float32: the
stages hand activations on unchanged); and when the worker dies, the requests in flight fail
at once rather than hang, the leader goes too, and the whole group comes back and answers
again, leaving nothing of the old one running.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.e2e.test_up import NAME, answers, stop_and_check_nothing_is_left, up
from tidegate.common.local_server import LocalServer
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import render

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "examples" / "multinode-tiny.yaml"
# Two processes compile their stages side by side on a small machine.
STARTUP_DEADLINE_S = 300.0
CLIENT_TIMEOUT_S = 30.0
QUICK_S = 15.0
RECOVERY_DEADLINE_S = 180.0
# Long enough that no generation ends before the fault, on however slow a machine.
MAX_TOKENS = 3000


def one_node_config(directory: Path) -> Path:
    """The example's rendered engine flags without its stages and nodes: the same model, dtype
    and scheduling in one process."""
    (resource,) = load_llm_deployments(MULTINODE)
    config_map = next(o for o in render(resource).objects if o["kind"] == "ConfigMap")
    flags = yaml.safe_load(config_map["data"]["unified.yaml"])
    assert (flags.pop("pipeline-parallel-size"), flags.pop("nnodes")) == (2, 2)
    assert flags["dtype"] == "float32"
    path = directory / "one-node.yaml"
    path.write_text(yaml.safe_dump(flags))
    return path


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tidegate serve` of the same model in one process: what the group must answer."""
    folder = tmp_path_factory.mktemp("reference")
    config = one_node_config(folder)
    server = LocalServer.tidegate_serve(
        tiny_llama_dir, "--config", str(config), "--host", "127.0.0.1", log=folder / "serve.log"
    )
    try:
        yield server.wait_healthy(90).base_url
    finally:
        server.stop()


class Group:
    """The running `tidegate up`: its leader and worker, as its log names them."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        log = server.log()
        (self.leader,) = re.findall(r"^unified +(\S+) +\d+ +http://", log, re.MULTILINE)
        (self.worker,) = re.findall(r"^unified +(\S+) +\d+ +- +nodeRank=1", log, re.MULTILINE)

    @property
    def url(self) -> str:
        return self.server.base_url

    def log(self) -> str:
        return self.server.log()

    def pid(self, name: str) -> int:
        """The pod's process now: the one in up's table, or the last restart's."""
        quoted = re.escape(name)
        found = re.findall(
            rf"^\w+ +{quoted} +(\d+) |{quoted} restarted \(pid (\d+)\)", self.log(), re.M
        )
        return int("".join(found[-1]))

    def processes(self, name: str) -> list[psutil.Process]:
        pod = psutil.Process(self.pid(name))
        return [pod, *pod.children(recursive=True)]

    def wait_log(self, pattern: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while re.search(pattern, self.log(), re.MULTILINE) is None:
            assert time.monotonic() < deadline, f"no /{pattern}/ in:\n{self.log()}"
            time.sleep(0.05)  # polling with a deadline


@pytest.fixture(scope="module")
def group(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    """The example under `tidegate up`; nothing it ran is left once it stops."""
    server = up(MULTINODE, tiny_llama_dir, tmp_path_factory.mktemp("up-multinode"))
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while "serving on" not in server.log():
            assert server.process.poll() is None, server.log()
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)  # polling with a deadline
        yield Group(server)
    finally:
        stop_and_check_nothing_is_left(server)


def test_the_group_answers_with_the_tokens_of_one_process(group: Group, reference: str) -> None:
    assert answers(group.url) == answers(reference)


def running(base_url: str) -> float:
    """tidegate:num_requests_running, from the leader's /metrics."""
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.split("{")[0].split(" ")[0] == "tidegate:num_requests_running":
            return float(line.rpartition(" ")[2])
    return 0.0


async def kill_worker_under_load(group: Group) -> tuple[list[str], list[str], float]:
    """Two streams decoding and a request waiting for its response; then SIGKILL the worker.
    What each stream and the request saw ("error": an error event or status, "cut": the
    connection closed, "finished": a normal end), and how long they took to end."""
    body = {"model": NAME, "prompt": "tide", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=group.url, timeout=CLIENT_TIMEOUT_S) as client:
        responses = []
        for _ in range(2):
            request = client.build_request("POST", "/v1/completions", json={**body, "stream": True})
            responses.append(await client.send(request, stream=True))
            assert responses[-1].status_code == 200, await responses[-1].aread()
        lines = [response.aiter_lines() for response in responses]
        for stream in lines:
            async for line in stream:  # decoding
                if line.startswith("data: "):
                    break

        async def post() -> str:
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                raise AssertionError("the request hung") from None
            except httpx.TransportError:
                return "cut"
            if response.status_code == 503:
                assert response.json()["error"]["message"], response.text
                return "error"
            return f"finished {response.status_code}"

        pending = asyncio.ensure_future(post())
        deadline = time.monotonic() + QUICK_S
        while await asyncio.to_thread(running, group.url) < 3:
            assert time.monotonic() < deadline, "the requests are not all in flight"
            await asyncio.sleep(0.05)  # polling with a deadline

        psutil.Process(group.pid(group.worker)).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        async def end_of(stream: AsyncIterator[str]) -> str:
            try:
                async for line in stream:
                    if line.startswith("data: ") and '"error"' in line:
                        return "error"
                    if line == "data: [DONE]":
                        return "finished"
            except httpx.TimeoutException:
                raise AssertionError("a stream hung") from None
            except httpx.TransportError:
                return "cut"
            return "cut"

        streams = [await end_of(stream) for stream in lines]
        request = await pending
        seconds = time.monotonic() - killed_at
        for response in responses:
            await response.aclose()
    return streams, [request], seconds


def test_a_dead_worker_fails_the_requests_in_flight_and_the_group_comes_back(
    group: Group, reference: str
) -> None:
    leader_pid, worker_pid = group.pid(group.leader), group.pid(group.worker)
    old = [*group.processes(group.leader), *group.processes(group.worker)]

    streams, pending, seconds = asyncio.run(kill_worker_under_load(group))
    print(f"\nworker killed: streams {streams}, pending {pending}, all ended in {seconds:.1f} s")
    # The leader fails them: an error event ends each stream, the waiting request gets a 503.
    assert (streams, pending) == (["error", "error"], ["error"])
    assert seconds < QUICK_S

    # The group goes down as a unit, and comes back as one.
    worker = re.escape(group.worker)
    group.wait_log(rf"{worker} \(pid {worker_pid}\) exited with code 137 \(SIGKILL\)", QUICK_S)
    group.wait_log(rf"group {re.escape(group.leader)} stopped; restarting its 2 pods", QUICK_S)
    group.wait_log(rf"{re.escape(group.leader)} restarted \(pid \d+\)", RECOVERY_DEADLINE_S)
    group.wait_log(rf"{worker} restarted \(pid \d+\)", QUICK_S)
    assert group.pid(group.leader) != leader_pid and group.pid(group.worker) != worker_pid
    _, alive = psutil.wait_procs(old, timeout=QUICK_S)
    assert not alive, f"left running: {alive}"

    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{group.url}/health", timeout=5).status_code == 200:
                break
        assert time.monotonic() < deadline, f"not answering again:\n{group.log()}"
        time.sleep(0.2)  # polling with a deadline
    assert answers(group.url) == answers(reference)
