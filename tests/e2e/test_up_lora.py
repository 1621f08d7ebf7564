"""`tidegate up` with spec.adapters: saving the manifest with other adapters changes what the
running engine serves, without restarting a process, as a ConfigMap edit does in a cluster."""

from __future__ import annotations

import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tests.e2e.test_up import stop_and_check_nothing_is_left, wait_serving
from tidegate.common.local_server import LocalServer, free_port, tidegate_command
from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lora-tiny.yaml"
PROMPT = "The harbour master said"
# up looks at the manifest every second and the engine at its adapters file every 2 s; the
# rest is loading a tiny adapter. Generous, since the test waits only as long as it must.
CHANGE_DEADLINE_S = 30.0


def manifest(model_dir: Path, adapters: dict[str, Path]) -> str:
    """The example with this machine's model folder and the adapters given: a folder is a
    hostPath source, an archive a uri one (which up fetches with `tidegate fetch-model`)."""
    resource = yaml.safe_load(EXAMPLE.read_text())
    spec = resource["spec"]
    spec["model"]["source"] = {"hostPath": {"path": str(model_dir)}}
    spec["adapters"] = [
        {
            "name": name,
            "source": {"hostPath": {"path": str(path)}}
            if path.is_dir()
            else {"uri": path.as_uri()},
        }
        for name, path in adapters.items()
    ]
    return yaml.safe_dump(resource, sort_keys=False)


def archive(folder: Path) -> Path:
    """A .tar.gz of the folder's contents, beside it."""
    path = folder.with_name(f"{folder.name}.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for file in sorted(folder.iterdir()):
            tar.add(file, arcname=file.name)
    return path


def complete(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def served_models(base_url: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{base_url}/v1/models", timeout=10)
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def ready_adapters(base_url: str) -> set[str]:
    """The adapters whose `tidegate:lora_adapter_ready` series is 1."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = r'^tidegate:lora_adapter_ready\{adapter="([^"]+)"\} 1(?:\.0)?$'
    return set(re.findall(pattern, text, flags=re.MULTILINE))


def wait_for(holds: Callable[[], bool], what: str, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + CHANGE_DEADLINE_S
    while not holds():
        assert time.monotonic() < deadline, f"not within {CHANGE_DEADLINE_S} s: {what}\n{log()}"
        time.sleep(0.2)  # polling with a deadline


def engine_processes(server: LocalServer) -> dict[str, int]:
    """The engine's processes under up, by process title (tidegate::api and its core)."""
    found = {}
    for process in psutil.Process(server.process.pid).children(recursive=True):
        try:
            title = process.cmdline()[0]
        except (psutil.NoSuchProcess, IndexError):
            continue
        if title.startswith("tidegate::"):
            found[title] = process.pid
    return found


def test_adapters_added_and_removed_in_the_manifest_are_served_without_a_restart(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    # Unified: one engine serves the public port, so no router path needs checking here.
    assert example["spec"]["topology"]["mode"] == "unified", "check the adapters via the router"
    base = example["spec"]["model"]["name"]
    first, second = (adapter["name"] for adapter in example["spec"]["adapters"][:2])
    # The second comes as an archive: up fetches it, as an init container would in a cluster.
    folders = {
        first: make_tiny_adapter(tiny_llama_dir, tmp_path / first, seed=1),
        second: archive(make_tiny_adapter(tiny_llama_dir, tmp_path / second, seed=2)),
    }
    file = tmp_path / "lora.yaml"
    file.write_text(manifest(tiny_llama_dir, {first: folders[first]}))
    port = free_port()
    command = [*tidegate_command(), "up", "-f", str(file), "--port", str(port)]
    server = LocalServer(command, port, log=tmp_path / "up.log")
    url = server.base_url
    try:
        wait_serving(server)
        cards = served_models(url)
        assert cards[first]["parent"] == base and second not in cards
        base_text = complete(url, base).json()["choices"][0]["text"]
        adapted = complete(url, first)
        assert adapted.status_code == 200, adapted.text
        assert adapted.json()["choices"][0]["text"] != base_text
        engines = engine_processes(server)
        assert "tidegate::api" in engines, engines
        # spec.lora reached the engine through the rendered config.
        max_loras = example["spec"].get("lora", {}).get("maxLoras", 1)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert f'tidegate:lora_requests_info{{max_lora="{max_loras}"' in metrics, metrics

        # Saved with a second adapter: listed, ready, and served by the same processes.
        file.write_text(manifest(tiny_llama_dir, folders))
        wait_for(lambda: second in served_models(url), f"{second} in /v1/models", server.log)
        assert ready_adapters(url) == {first, second}
        added = complete(url, second)
        assert added.status_code == 200, added.text
        assert added.json()["choices"][0]["text"] != base_text
        assert engine_processes(server) == engines

        # Saved without the first: its model name is refused, the second is still served.
        file.write_text(manifest(tiny_llama_dir, {second: folders[second]}))
        wait_for(lambda: complete(url, first).status_code == 404, f"{first} gone", server.log)
        assert first not in served_models(url)
        assert ready_adapters(url) == {second}
        assert complete(url, second).status_code == 200
        assert engine_processes(server) == engines
        log = server.log()
        assert f"adapters: {first}, {second} now listed" in log
        assert f"adapters: {second} now listed" in log
        assert not re.search(r"exited with code|restarted|restart tidegate up", log), log
    finally:
        stop_and_check_nothing_is_left(server)
