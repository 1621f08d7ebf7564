"""Process topology and failures: what Kubernetes and clients see when things go wrong."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.client import HEADERS, metric, open_stream, wait_for
from tests.e2e.conftest import API_KEY, SERVED_NAME
from tests.e2e.server import ServerProcess
from tidegate.engine.http_server import DRAINING_HEADER
from tidegate.engine.worker.fault_injection import FAULT_SIGNAL_ENV

# Worker processes even at one rank: the tests that kill a worker process run this path.
MP = ("--distributed-executor-backend", "mp")
ASYNC = ("--async-scheduling",)
# A step of the model raises once the process that runs it gets SIGUSR1 (test-only hook).
STEP_FAULT = {FAULT_SIGNAL_ENV: "USR1"}


# The SIGTERM test's stream in flight.
STREAM_TOKENS = 1000


def start_server(
    tiny_llama_dir: Path, tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> ServerProcess:
    return ServerProcess(
        tiny_llama_dir,
        tmp_path,
        "--served-model-name",
        SERVED_NAME,
        "--api-key",
        API_KEY,
        *flags,
        env=env,
    ).wait_healthy()


def test_at_one_rank_the_model_runs_in_the_named_engine_core(server):
    children = server.children()
    assert set(children) == {"tidegate::engine_core_0"}  # no worker process (uni)
    api = psutil.Process(server.process.pid)
    assert " ".join(api.cmdline()).strip() == "tidegate::api"
    assert children["tidegate::engine_core_0"].ppid() == api.pid
    assert "compilation level" in server.log() and "worker process" not in server.log()


def test_with_worker_processes_api_engine_core_and_worker_are_named(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, *MP)
    try:
        children = server.children()
        assert set(children) == {"tidegate::engine_core_0", "tidegate::worker_tp0"}
        api = psutil.Process(server.process.pid)
        assert " ".join(api.cmdline()).strip() == "tidegate::api"
        pids = {api.pid, *(child.pid for child in children.values())}
        assert len(pids) == 3
        worker = children["tidegate::worker_tp0"]
        assert worker.ppid() == children["tidegate::engine_core_0"].pid
        assert worker.name().startswith("tidegate::work")  # `top` shows the 15-byte comm
    finally:
        assert server.stop() == 0


def test_client_disconnect_mid_stream_frees_its_kv_blocks(tiny_llama_dir, tmp_path):
    # Its own server, with the model's whole context: the request could run for seconds, so
    # its end cannot come before the disconnect however slow the client is.
    server = start_server(tiny_llama_dir, tmp_path)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            stream = await open_stream(client, max_tokens=4000)
            for _ in range(5):
                assert await stream.next_event() is not None
            assert metric(server.base_url, "tidegate:kv_cache_usage_perc") > 0
            await stream.response.aclose()

    try:
        asyncio.run(run())
        wait_for(
            lambda: (
                metric(server.base_url, "tidegate:num_requests_running") == 0
                and metric(server.base_url, "tidegate:kv_cache_usage_perc") == 0
            ),
            10,
            "the disconnected request's blocks to be freed",
        )
        # Freed because it was aborted, not because it ran to its end.
        assert (
            metric(server.base_url, "tidegate:request_success_total", finished_reason="abort") == 1
        )
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [(), MP], ids=["uni", "mp"])
def test_engine_core_death_fails_requests_and_the_server_exits_nonzero(
    tiny_llama_dir, tmp_path, flags
):
    _assert_death_is_fatal(tiny_llama_dir, tmp_path, "tidegate::engine_core_0", flags)


def test_worker_death_fails_requests_and_the_server_exits_nonzero(tiny_llama_dir, tmp_path):
    _assert_death_is_fatal(tiny_llama_dir, tmp_path, "tidegate::worker_tp0", MP)


@pytest.mark.parametrize(
    ("flags", "victim"),
    [
        ((), "tidegate::engine_core_0"),
        (MP, "tidegate::worker_tp0"),
        # Two steps in flight: the one that raises runs on the worker thread (uni) or in the
        # worker process (mp) while the engine core plans the next.
        (ASYNC, "tidegate::engine_core_0"),
        ((*MP, *ASYNC), "tidegate::worker_tp0"),
    ],
    ids=["uni", "mp", "uni-async", "mp-async"],
)
def test_a_step_that_raises_fails_requests_and_the_server_exits_1(
    tiny_llama_dir, tmp_path, flags, victim
):
    # uni: the exception ends the engine core's loop; mp: the worker reports it and exits 1.
    log = _assert_death_is_fatal(
        tiny_llama_dir, tmp_path, victim, flags, signal.SIGUSR1, env=STEP_FAULT
    )
    assert "InjectedStepFault" in log


def _assert_death_is_fatal(
    model_dir: Path,
    tmp_path: Path,
    victim_title: str,
    flags: tuple[str, ...],
    sig: signal.Signals = signal.SIGKILL,
    env: dict[str, str] | None = None,
) -> str:
    """Fault `victim_title` with `sig` under load; return the server's log."""
    server = start_server(model_dir, tmp_path, *flags, env=env)
    try:
        victim = server.children()[victim_title]
        core = server.children()["tidegate::engine_core_0"]
        others = [p for t, p in server.children().items() if t != victim_title]
        if sig != signal.SIGKILL:
            others.append(victim)  # it is to exit by itself

        async def run() -> tuple[list[list[dict]], httpx.Response, float]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                streams = [await open_stream(client, max_tokens=3000) for _ in range(2)]
                for stream in streams:  # both are producing tokens
                    assert await stream.next_event() is not None
                pending = asyncio.ensure_future(
                    client.post(
                        "/v1/completions",
                        json={
                            "model": SERVED_NAME,
                            "prompt": "x",
                            "max_tokens": 3000,
                            "ignore_eos": True,
                        },
                        headers=HEADERS,
                    )
                )
                # The kill must find it in the engine: one that reached the server only
                # after the shutdown began gets its connection closed, not a 503.
                await asyncio.to_thread(
                    wait_for,
                    lambda: metric(server.base_url, "tidegate:num_requests_running") == 3,
                    15,
                    "the third request to run",
                )
                killed_at = time.monotonic()
                victim.send_signal(sig)
                events = [await stream.rest() for stream in streams]
                return events, await pending, killed_at

        events, pending, killed_at = asyncio.run(run())
        for stream_events in events:
            assert "error" in stream_events[-1], stream_events[-1]
            assert stream_events[-1]["error"]["type"] == "server_error"
        assert pending.status_code == 503, pending.text
        assert "error" in pending.json()
        code = server.wait_exit(timeout=15)
        assert time.monotonic() - killed_at < 15
        assert code == 1
        psutil.wait_procs(others, timeout=10)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in others)
        log = server.log()
        if sig != signal.SIGKILL:
            assert f"engine core pid {core.pid} exited with code 1" in log
        return log
    finally:
        server.stop()


# Alone: the third request must arrive while the queue is still full, before the first
# stream's 400 tokens run out (beside another module it came too late, once in 3 runs; a
# longer runway would lengthen the drain after SIGTERM).
@pytest.mark.alone
def test_full_queue_answers_429_then_sigterm_drains_and_exits_zero(tiny_llama_dir, tmp_path):
    server = start_server(
        tiny_llama_dir, tmp_path, "--max-num-seqs", "1", "--max-waiting-requests", "1"
    )

    async def run() -> tuple[httpx.Response, list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            running = await open_stream(client, max_tokens=400)
            waiting = asyncio.ensure_future(open_stream(client, max_tokens=20))
            await asyncio.to_thread(
                wait_for,
                lambda: metric(server.base_url, "tidegate:num_requests_waiting") == 1,
                10,
                "the second request to wait",
            )
            refused = await client.post(
                "/v1/completions",
                json={"model": SERVED_NAME, "prompt": "x", "max_tokens": 5},
                headers=HEADERS,
            )
            # Both admitted requests are in flight when the pod is told to stop.
            server.process.send_signal(signal.SIGTERM)
            first = await running.rest()
            second = await (await waiting).rest()
            return refused, first, second

    refused, first, second = asyncio.run(run())
    assert refused.status_code == 429
    assert refused.headers["retry-after"]
    assert (
        refused.json()["error"]["type"] == "rate_limit_error" or refused.json()["error"]["message"]
    )
    assert "waiting queue is full" in refused.json()["error"]["message"]
    # Drained: both requests finished in full after SIGTERM.
    assert first[-1]["choices"][0]["finish_reason"] == "length"
    assert second[-1]["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base_url}/health", timeout=2)
    server.stop()


def test_on_sigterm_health_is_503_at_once_new_requests_refused_and_a_stream_finishes(
    tiny_llama_dir, tmp_path
):
    server = start_server(tiny_llama_dir, tmp_path)
    core = server.children()["tidegate::engine_core_0"]

    async def run() -> tuple[list[httpx.Response], list[dict], bool]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            # Long enough that it cannot end between its first event and the SIGSTOP below,
            # even when this process is descheduled that long on a loaded machine (with 40
            # tokens it once did: the drain ended at once and /health refused connections).
            stream = await open_stream(client, max_tokens=STREAM_TOKENS)
            first = await stream.next_event()
            # The engine core stops stepping, so the stream is surely still in flight while
            # the drain is looked at, however fast the machine.
            core.send_signal(signal.SIGSTOP)
            try:
                server.process.send_signal(signal.SIGTERM)
                # No wait: /health is 503 from the signal on (routers and probes turn away).
                await asyncio.to_thread(
                    wait_for,
                    lambda: httpx.get(f"{server.base_url}/health").status_code == 503,
                    2,
                    "/health to turn 503",
                )
                body = {"model": SERVED_NAME, "prompt": "x", "max_tokens": 5}
                answers = [
                    await client.get("/health"),
                    await client.post("/v1/completions", json=body, headers=HEADERS),
                    await client.get("/metrics"),
                ]
            finally:
                core.send_signal(signal.SIGCONT)
            return answers, [first, *await stream.rest()], stream.done

    (health, refused, metrics), events, done = asyncio.run(run())
    for response in (health, refused):
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["param"] is None
        assert "shutting down" in error["message"]
    assert DRAINING_HEADER in refused.headers  # nothing ran: a router may hold it elsewhere
    assert metrics.status_code == 200  # scrapers still read the last requests
    # The stream in flight finished in full (all its tokens, then [DONE]), then the server
    # exited cleanly.
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit(timeout=30) == 0
    server.stop()


@pytest.mark.parametrize(("flags", "processes"), [((), 1), (MP, 2)], ids=["uni", "mp"])
def test_api_server_death_takes_the_engine_processes_with_it(
    tiny_llama_dir, tmp_path, flags, processes
):
    server = start_server(tiny_llama_dir, tmp_path, *flags)
    children = list(server.children().values())
    assert len(children) == processes
    server.process.send_signal(signal.SIGKILL)
    server.wait_exit(timeout=10)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned engine processes: {alive}"
    server.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "/nonexistent/model"], "has no config.json"),
        (["--num-gpu-blocks", "2"], "fewer than max_model_len"),
        (["--max-model-len", "1000000"], "exceeds this model's limit"),
    ],
    ids=["missing folder", "kv cache too small", "context beyond the model"],
)
def test_a_server_that_cannot_start_exits_1_and_says_why(tiny_llama_dir, tmp_path, flags, message):
    server = ServerProcess(tiny_llama_dir, tmp_path, *flags)
    assert server.wait_exit(timeout=60) == 1
    assert message in server.log()
    server.stop()
