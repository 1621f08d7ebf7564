"""`tidegate up` runs an LLMDeployment's rendered pods as local processes, as a cluster would."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.e2e.server import rendered_config
from tidegate.common.local_server import LocalServer, free_port, tidegate_command
from tidegate.operator.manifest import load_llm_deployments

REPO = Path(__file__).resolve().parents[2]
UNIFIED = REPO / "examples" / "unified-tiny.yaml"
DISAGGREGATED = REPO / "examples" / "disaggregated-tiny.yaml"
NAME = "tiny-llama"  # the examples' served model name


def up(
    example: Path, model_dir: Path, logs: Path, env: dict[str, str] | None = None
) -> LocalServer:
    port = free_port()
    command = [*tidegate_command(), "up", "-f", str(example), "--model-dir", str(model_dir)]
    log = logs / f"up-{example.stem}.log"
    return LocalServer([*command, "--port", str(port)], port, log=log, env=env)


def wait_serving(server: LocalServer) -> None:
    """Until up has printed its table (every pod ready; the port may answer earlier)."""
    deadline = time.monotonic() + 180
    while "serving on" not in server.log():
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)  # polling with a deadline


def descendants(server: LocalServer) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children(recursive=True)


def stop_and_check_nothing_is_left(server: LocalServer) -> None:
    started = [*descendants(server)]
    # Every pod runs in its own session: find them by the sessions up started too.
    assert server.stop(timeout=60) == 0, server.log()
    deadline = time.monotonic() + 20
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)  # polling with a deadline
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tidegate serve` with the unified example's rendered config: what up must equal."""
    folder = tmp_path_factory.mktemp("reference")
    config = rendered_config(load_llm_deployments(str(UNIFIED))[0], "unified", folder)
    server = LocalServer.tidegate_serve(
        tiny_llama_dir, "--config", str(config), "--host", "127.0.0.1",
        log=folder / "serve.log",
    )  # fmt: skip
    try:
        yield server.wait_healthy(90).base_url
    finally:
        server.stop()


PROMPTS = ["The tide", "hello " * 30, [(7 * i) % 900 + 3 for i in range(300)]]


def answers(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    texts = [
        client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0
    )
    return [*texts, chat.choices[0].message.content]


@pytest.mark.parametrize("example", [UNIFIED, DISAGGREGATED], ids=["unified", "disaggregated"])
def test_up_serves_the_example_as_tidegate_serve_does_and_leaves_nothing(
    example: Path, reference: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = up(example, tiny_llama_dir, tmp_path)
    try:
        wait_serving(server)
        assert answers(server.base_url) == answers(reference)
    finally:
        stop_and_check_nothing_is_left(server)


def test_a_missing_model_folder_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [*tidegate_command(), "up", "-f", str(UNIFIED), "--model-dir", str(missing)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"model folder {missing} not found" in result.stdout


def test_a_file_without_a_local_model_source_asks_for_one(tmp_path: Path) -> None:
    manifest = tmp_path / "pvc.yaml"
    manifest.write_text(
        UNIFIED.read_text().replace(
            "hostPath:\n        path: /models/tiny-llama", "pvc:\n        claimName: models"
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "tidegate.cli", "up", "-f", str(manifest)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "comes from a pvc; give its local folder with --model-dir" in result.stdout
