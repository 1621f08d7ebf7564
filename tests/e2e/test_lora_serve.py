"""LoRA adapters through `tidegate serve`: `model` selects one, /v1/models lists them, adapters
load and unload at run time (routes and a watched file) without losing a request."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.server import ServerProcess
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

KEY = "sk-lora-5e1d0c2b"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny"
PROMPT = "The harbour master said"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_tiny_adapter(tiny_llama_dir, root / "a1", rank=8, seed=1),
        "a2": make_tiny_adapter(tiny_llama_dir, root / "a2", rank=4, seed=2),
        "a3": make_tiny_adapter(tiny_llama_dir, root / "a3", rank=16, seed=3),
        "too-big": make_tiny_adapter(tiny_llama_dir, root / "too-big", rank=32, seed=4),
    }


@pytest.fixture(scope="module")
def adapter_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "adapters.yaml"
    path.write_text("[]\n")
    return path


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    adapter_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("lora-serve")
    key_file = directory / "api-key"
    key_file.write_text(KEY + "\n")
    proc = ServerProcess(
        tiny_llama_dir,
        directory,
        "--served-model-name",
        BASE,
        "--api-key-file",
        str(key_file),
        "--max-model-len",
        "512",
        "--metrics-compat",
        "vllm",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"a1={adapters['a1']}",
        "--lora-modules-file",
        str(adapter_file),
        "--allow-runtime-lora-updates",
    ).wait_healthy()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def complete(server: ServerProcess, model: str, prompt: str = PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)


def model_ids(server: ServerProcess) -> dict[str, dict]:
    response = httpx.get(f"{server.base_url}/v1/models", headers=AUTH)
    assert response.status_code == 200
    return {card["id"]: card for card in response.json()["data"]}


def wait_for(predicate, what: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {deadline_s} s: {what}")


def test_model_selects_an_adapter_with_the_offline_engines_tokens(server, tiny_llama_dir, adapters):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True) as llm:
        base = llm.generate(PROMPT, greedy)[0].outputs[0].text
        lora = llm.load_lora("a1", str(adapters["a1"]))
        adapted = llm.generate(PROMPT, greedy, lora_request=lora)[0].outputs[0].text
    assert adapted != base
    served = complete(server, "a1")
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == adapted
    assert served.json()["model"] == "a1"
    assert complete(server, BASE).json()["choices"][0]["text"] == base


def test_models_lists_each_adapter_with_its_parent(server, adapters):
    cards = model_ids(server)
    assert cards[BASE]["parent"] is None
    assert cards["a1"]["parent"] == BASE
    assert cards["a1"]["root"] == str(adapters["a1"])
    one = httpx.get(f"{server.base_url}/v1/models/a1", headers=AUTH)
    assert one.status_code == 200 and one.json()["parent"] == BASE


def test_an_unknown_adapter_is_a_404_naming_what_is_served(server):
    response = complete(server, "nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "'a1'" in error["message"]


def test_runtime_routes_need_the_api_key(server, adapters):
    body = {"lora_name": "x", "lora_path": str(adapters["a2"])}
    response = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body)
    assert response.status_code == 401
    assert "x" not in model_ids(server)


def test_load_use_and_unload_at_run_time(server, adapters, tmp_path):
    url = server.base_url
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    for path, message in [
        (broken, "no adapter_model.safetensors"),
        (adapters["too-big"], "exceeds this server's max_lora_rank 16"),
        (tmp_path / "absent", "is not a directory"),
    ]:
        body = {"lora_name": "bad", "lora_path": str(path)}
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
        assert "bad" not in model_ids(server)  # nothing half-loaded
    body = {"lora_name": "rt", "lora_path": str(adapters["a2"])}
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH)
    assert again.status_code == 400 and "already loaded" in again.text
    assert complete(server, "rt").status_code == 200
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"}, headers=AUTH)
    assert gone.status_code == 200, gone.text
    assert complete(server, "rt").status_code == 404
    unknown = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"}, headers=AUTH)
    assert unknown.status_code == 404


def test_the_adapter_file_is_followed_without_a_restart(server, adapters, adapter_file):
    pid = server.process.pid
    adapter_file.write_text(yaml.safe_dump([{"name": "from-file", "path": str(adapters["a3"])}]))
    wait_for(lambda: "from-file" in model_ids(server), "the file's adapter served")
    assert complete(server, "from-file").status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'tidegate:lora_adapter_ready{adapter="from-file"} 1.0' in metrics
    assert 'tidegate:lora_adapter_ready{adapter="a1"} 1.0' in metrics
    info = re.search(r"^vllm:lora_requests_info\{(.*)\} ", metrics, re.M)
    assert info is not None and 'max_lora="2"' in info.group(1)
    adapter_file.write_text("[]\n")
    wait_for(lambda: "from-file" not in model_ids(server), "the removed adapter dropped")
    assert "a1" in model_ids(server)  # --lora-modules adapters are not the file's to drop
    assert server.process.pid == pid and server.process.poll() is None


def test_loading_and_unloading_under_load_loses_no_request(server, adapters):
    """Streams under the base model and two adapters run while a third adapter is loaded and
    unloaded over and over: every one finishes with its tokens."""

    async def stream(client: httpx.AsyncClient, model: str) -> tuple[int, str | None, int]:
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        finish, tokens = None, 0
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                for choice in chunk["choices"]:
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            return r.status_code, finish, tokens

    async def churn(client: httpx.AsyncClient, stop: asyncio.Event) -> int:
        cycles = 0
        body = {"lora_name": "churn", "lora_path": str(adapters["a2"])}
        while not stop.is_set():
            loaded = await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
            assert loaded.status_code == 200, loaded.text
            used = await client.post(
                "/v1/completions",
                json={"model": "churn", "prompt": PROMPT, "max_tokens": 4},
                headers=AUTH,
            )
            assert used.status_code == 200, used.text
            gone = await client.post(
                "/v1/unload_lora_adapter", json={"lora_name": "churn"}, headers=AUTH
            )
            assert gone.status_code == 200, gone.text
            cycles += 1
        return cycles

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            stop = asyncio.Event()
            churner = asyncio.create_task(churn(client, stop))
            models = [BASE, "a1", "a2-file"] * 3
            results = await asyncio.gather(*(stream(client, m) for m in models))
            stop.set()
            assert await churner >= 1
        for status, finish, tokens in results:
            assert (status, finish, tokens) == (200, "length", 40)

    # Three adapters (four with churn) compete for the server's two slots.
    body = {"lora_name": "a2-file", "lora_path": str(adapters["a2"])}
    loaded = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, headers=AUTH)
    assert loaded.status_code == 200, loaded.text
    asyncio.run(main())
    stats = httpx.get(f"{server.base_url}/metrics").text
    running = re.search(r"^tidegate:num_requests_running\{[^}]*\} (\S+)", stats, re.M)
    assert running is not None and float(running.group(1)) == 0
