"""`tidegate router` as the operator's pods run it: flags or --config, stopped by SIGTERM."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import wait_until
from tidegate.cli import main
from tidegate.common.local_server import free_port, tidegate_command

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def run_router_process(args: list[str], port: int, log: Path) -> None:
    """Start the CLI, serve one request through it, stop it with SIGTERM: exit code 0."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [*tidegate_command(), "router", *args], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: process.poll() is not None or healthy(url), 30.0, what="the router process"
        )
        assert process.poll() is None, log.read_text()
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=10.0)
        assert response.status_code == 200
        assert response.json()["choices"] == [{"text": "one two 3"}]
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert cmdline.startswith(b"tidegate::router")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_router_command_serves_and_stops_cleanly_on_sigterm(backend, tmp_path):
    prefill, decode = backend("prefill"), backend("decode")
    port = free_port()
    flags = ["--prefill", prefill.url, "--decode", decode.url, "--host", "127.0.0.1"]
    run_router_process([*flags, "--port", str(port)], port, tmp_path / "router.log")
    assert len(prefill.engine.received) == len(decode.engine.received) == 1


def test_the_router_command_reads_its_config_file(backend, tmp_path):
    prefill, decode = backend("prefill"), backend("decode")
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text(
        f"prefill:\n- {prefill.url}\ndecode:\n- {decode.url}\nhost: 127.0.0.1\n"
        "port: 1\nhealth-interval: 0.5\n"
    )
    # The command line wins over the file.
    run_router_process(["--config", str(config), "--port", str(port)], port, tmp_path / "r.log")
    assert decode.engine.received[0].headers["x-request-id"]


def test_the_router_command_names_missing_flags(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["router", "--prefill", "http://127.0.0.1:1"])
    assert exited.value.code == 2
    assert "the following arguments are required: --decode" in capsys.readouterr().err
