"""SIGKILL of each process of a disaggregated deployment under `tidegate up`, and a model step
that raises in the decode pod's engine core (its worker runs there at TP=1).

For every victim, with streaming and non-streaming requests in flight through the endpoint
(the router): each request ends in a clean error, or goes on untouched, and none hangs; the
pod's process exits non-zero, which is what makes Kubernetes (here up's supervisor) restart
it; the endpoint answers again once the restarted pod is ready; and nothing of the killed
pod is left running. One `tidegate up` serves every case: each leaves it recovered. And
should `tidegate up` itself be killed, its pods stop too.

Requests are kept in flight without depending on the machine's speed: generations are long,
and the requests that must be caught in their prefill leg are held there by stopping
(SIGSTOP) the prefill instance's engine core.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.test_up import DISAGGREGATED, NAME, UNIFIED, up, wait_serving
from tidegate.common.local_server import LocalServer
from tidegate.engine.worker.fault_injection import FAULT_SIGNAL_ENV

pytestmark = pytest.mark.slow

# A hang runs into the client's timeout; a clean failure comes well before it.
CLIENT_TIMEOUT_S = 30.0
QUICK_S = 10.0
RECOVERY_DEADLINE_S = 90.0
# Long enough that no generation ends before the fault, on however slow a machine.
MAX_TOKENS = 3000


def title(process: psutil.Process) -> str:
    """The process's title ("" once it is gone)."""
    with contextlib.suppress(psutil.NoSuchProcess, IndexError):
        return process.cmdline()[0]
    return ""


def test_the_pods_stop_when_up_itself_is_killed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # A crash, the OOM killer or a CI job's timeout; SIGTERM and Ctrl-C are test_up.py's.
    server = up(UNIFIED, tiny_llama_dir, tmp_path)
    alive: list[psutil.Process] = []
    try:
        wait_serving(server)
        pods = psutil.Process(server.process.pid).children(recursive=True)
        assert "tidegate::api" in {title(p) for p in pods}
        server.process.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(pods, timeout=QUICK_S)
        assert not alive, f"left running without up: {alive}"
    finally:
        for process in alive:
            process.kill()
        server.stop()


@dataclass(frozen=True)
class Fault:
    """One process to signal, and what the clients and the supervisor see."""

    role: str  # the pod of the victim: prefill, decode or router
    title: str  # the victim's process title
    streams: str  # open streams: "error" (an error event, then [DONE]), "go on" or "cut"
    pending: str  # requests not answered yet: "503" (OpenAI's error body) or "cut"
    exit_code: str  # the pod's exit as up reports it, the way Kubernetes shows a container's
    sig: signal.Signals = signal.SIGKILL  # SIGUSR1: the victim's next model step raises


FAULTS = [
    Fault("decode", "tidegate::engine_core_0", "error", "503", "1"),
    # Its streams have their KV on the decode instance already and go on. Requests in their
    # prefill leg get a 503 with Retry-After: the router does not move the prompt to a
    # decode instance (docs/disaggregated.md says why).
    Fault("prefill", "tidegate::api", "go on", "503", "137 (SIGKILL)"),
    # At TP=1 the decode pod's worker runs inside its engine core: a step that raises there.
    Fault("decode", "tidegate::engine_core_0", "error", "503", "1", signal.SIGUSR1),
    # The clients' connections were the router's: their closing is all a client can see.
    Fault("router", "tidegate::router", "cut", "cut", "137 (SIGKILL)"),
    Fault("decode", "tidegate::api", "error", "503", "137 (SIGKILL)"),
]


class Deployment:
    """The running `tidegate up`: its pods, as its log names them, and every process seen."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        table = re.findall(r"^(\w+)\s+(\S+)\s+\d+\s+(http://\S+)", server.log(), re.MULTILINE)
        self.names = {role: name for role, name, _ in table}
        self.urls = {role: url for role, _, url in table}
        self.seen: set[psutil.Process] = set()

    @property
    def url(self) -> str:
        return self.server.base_url

    def pid(self, role: str) -> int:
        """The pod's process now: the one in up's table, or the last restart's."""
        name = re.escape(self.names[role])
        found = re.findall(
            rf"^\w+ +{name} +(\d+) |{name} restarted \(pid (\d+)\)", self.log(), re.M
        )
        return int("".join(found[-1]))

    def pod_processes(self, role: str) -> list[psutil.Process]:
        pod = psutil.Process(self.pid(role))
        return [pod, *pod.children(recursive=True)]

    def process(self, role: str, wanted: str) -> psutil.Process:
        """The process with this title among the pod's."""
        for process in self.pod_processes(role):
            if title(process) == wanted:
                return process
        raise AssertionError(f"no {wanted} in {self.names[role]}")

    def titles(self) -> collections.Counter[str]:
        """How many processes of each Tidegate title up runs now."""
        processes = psutil.Process(self.server.process.pid).children(recursive=True)
        self.seen.update(processes)
        return collections.Counter(t for p in processes if (t := title(p)).startswith("tidegate::"))

    def log(self) -> str:
        return self.server.log()

    def wait_log(self, pattern: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while re.search(pattern, self.log(), re.MULTILINE) is None:
            assert time.monotonic() < deadline, f"no /{pattern}/ in:\n{self.log()}"
            time.sleep(0.05)  # polling with a deadline


@pytest.fixture(scope="module")
def deployment(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """The disaggregated example under `tidegate up`; nothing it ran is left once it stops."""
    logs = tmp_path_factory.mktemp("up-faults")
    server = up(DISAGGREGATED, tiny_llama_dir, logs, env={FAULT_SIGNAL_ENV: "USR1"})
    try:
        wait_serving(server)
        deployment = Deployment(server)
        yield deployment
        deployment.titles()
    finally:
        code = server.stop(timeout=60)
    assert code == 0, server.log()
    _, alive = psutil.wait_procs(deployment.seen, timeout=20)
    assert not alive, f"left running: {alive}"


def gauge(base_url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry these labels, from /metrics."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(condition, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling with a deadline


def completion(prompt: str, stream: bool) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return {**body, "stream": stream}


@dataclass
class StreamEnd:
    """What a client read of a stream after the fault."""

    events: list[dict]
    done: bool  # it ended with data: [DONE]
    cut: httpx.TransportError | None  # the connection closed part-way


async def read_stream(lines: AsyncIterator[str], events_wanted: int | None = None) -> StreamEnd:
    """SSE events until [DONE], the connection's end, or `events_wanted` of them."""
    events: list[dict] = []
    try:
        async for line in lines:
            if line == "data: [DONE]":
                return StreamEnd(events, True, None)
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == events_wanted:
                    break
    except httpx.TransportError as error:
        return StreamEnd(events, False, error)
    return StreamEnd(events, False, None)


@dataclass
class Outcome:
    """What the clients of the requests in flight saw, and how soon."""

    streams: list[StreamEnd]
    pending: list[httpx.Response | httpx.TransportError]
    killed_at: float
    seconds: float  # from the kill until every request had ended (or the streams went on)


async def kill_under_load(deployment: Deployment, fault: Fault) -> Outcome:
    """Two streams decoding and requests waiting for their response; then SIGKILL the victim."""
    async with httpx.AsyncClient(base_url=deployment.url, timeout=CLIENT_TIMEOUT_S) as client:

        async def post(body: dict) -> httpx.Response | httpx.TransportError:
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.TransportError as error:
                assert not isinstance(error, httpx.TimeoutException), f"{body} hung"
                return error
            return response

        responses = []
        for i in range(2):
            request = client.build_request("POST", "/v1/completions", json=completion(f"{i}", True))
            responses.append(await client.send(request, stream=True))
            assert responses[-1].status_code == 200, await responses[-1].aread()
        streams = [response.aiter_lines() for response in responses]
        for stream in streams:
            assert (await read_stream(stream, 1)).events  # decoding
        held = None
        if fault.role == "prefill":
            held = deployment.process("prefill", "tidegate::engine_core_0")
            held.send_signal(signal.SIGSTOP)
            bodies = [completion("held", False), completion("held", True)]
            prefill = deployment.urls["prefill"]

            def in_flight() -> bool:
                in_prefill = gauge(deployment.url, "tidegate:router_backend_in_flight", url=prefill)
                return in_prefill == len(bodies)
        else:
            bodies = [completion("pending", False)]

            def in_flight() -> bool:
                running = gauge(deployment.urls["decode"], "tidegate:num_requests_running")
                return running == len(streams) + len(bodies)

        pending = [asyncio.ensure_future(post(body)) for body in bodies]
        await asyncio.to_thread(wait_until, in_flight, QUICK_S, "the requests to be in flight")

        deployment.process(fault.role, fault.title).send_signal(fault.sig)
        killed_at = time.monotonic()
        if held is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                held.send_signal(signal.SIGCONT)  # free to see its parent gone
        wanted = 3 if fault.streams == "go on" else None
        ends = [await read_stream(stream, wanted) for stream in streams]
        answers = [await each for each in pending]
        seconds = time.monotonic() - killed_at
        for response in responses:
            await response.aclose()
        return Outcome(ends, answers, killed_at, seconds)


def check_stream(end: StreamEnd, expected: str) -> None:
    if expected == "error":
        assert end.done and end.events and end.cut is None, end
        error = end.events[-1]["error"]
        assert error["type"] == "server_error" and error["message"], error
    elif expected == "go on":
        # A chunk per token; its text may be empty (bytes of a character not yet complete).
        assert len(end.events) == 3, end
        assert all(isinstance(e["choices"][0]["text"], str) for e in end.events), end
    else:
        assert isinstance(end.cut, httpx.RemoteProtocolError | httpx.ReadError), end


def check_pending(response: httpx.Response | httpx.TransportError, expected: str) -> None:
    if expected == "503":
        assert isinstance(response, httpx.Response), response
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["message"], error
        assert response.headers["retry-after"]
    else:
        assert isinstance(response, httpx.RemoteProtocolError | httpx.ReadError), response


def wait_answering(deployment: Deployment) -> None:
    """Poll the endpoint until a request succeeds; meanwhile it may only refuse cleanly."""
    body = {"model": NAME, "prompt": "again", "max_tokens": 4}
    started = time.monotonic()
    while time.monotonic() - started < RECOVERY_DEADLINE_S:
        with contextlib.suppress(httpx.ConnectError):  # the router is restarting
            response = httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=30)
            if response.status_code == 200:
                return
            assert response.status_code == 503 and response.json()["error"], response.text
        time.sleep(0.1)  # polling with a deadline
    raise AssertionError(f"not answering {RECOVERY_DEADLINE_S} s on:\n{deployment.log()}")


@pytest.mark.parametrize("fault", FAULTS, ids=[f"{f.role} {f.title} {f.sig.name}" for f in FAULTS])
def test_a_killed_process_fails_requests_cleanly_exits_nonzero_and_is_restarted(
    deployment: Deployment, fault: Fault
) -> None:
    titles = deployment.titles()
    pod_pid, pod_processes = deployment.pid(fault.role), deployment.pod_processes(fault.role)

    outcome = asyncio.run(kill_under_load(deployment, fault))
    for end in outcome.streams:
        check_stream(end, fault.streams)
    for response in outcome.pending:
        check_pending(response, fault.pending)
    assert outcome.seconds < QUICK_S

    name, code = re.escape(deployment.names[fault.role]), re.escape(fault.exit_code)
    exited = rf"{name} \(pid {pod_pid}\) exited with code {code}; restarting in \d+ s"
    deployment.wait_log(exited, QUICK_S)
    wait_answering(deployment)
    recovery_s = time.monotonic() - outcome.killed_at
    print(f"\n{fault.role} {fault.title}: answering again {recovery_s:.1f} s after the kill")
    assert deployment.pid(fault.role) != pod_pid  # through the restarted pod
    _, alive = psutil.wait_procs(pod_processes, timeout=QUICK_S)
    assert not alive, f"left running: {alive}"
    assert deployment.titles() == titles
    # Nothing goes on generating for a client that is gone.
    wait_until(
        lambda: gauge(deployment.urls["decode"], "tidegate:num_requests_running") == 0,
        QUICK_S,
        "the decode instance to be idle",
    )
