"""Tenants on one real server: no shared cached prefixes across them, no key in any output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.e2e.server import ServerProcess

KEY = "sk-tenancy-7f3c9a1e"
WRONG_KEY = "sk-guessed-0b8d2e44"  # perhaps another service's real key: not to be logged either
TENANT_HEADER = "X-Tenant-Id"
# Long enough for several full KV blocks (16 tokens each), so a hit is visible in usage.
PROMPT = "You are the harbour master's assistant. " * 12


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("tenancy")
    key_file = directory / "api-key"
    key_file.write_text(KEY + "\n")
    proc = ServerProcess(
        tiny_llama_dir,
        directory,
        "--served-model-name",
        SERVED_NAME,
        "--api-key-file",
        str(key_file),
        "--cache-salt-header",
        TENANT_HEADER.lower(),
        "--log-level",
        "debug",
    ).wait_healthy()
    try:
        yield proc
    finally:
        proc.stop()


def cached_tokens(server: ServerProcess, tenant: str | None, **extra) -> int:
    """Prompt tokens the server found cached for one request of `tenant` (None: no header)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 64
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_one_tenants_cached_prefix_is_invisible_to_another(server):
    assert cached_tokens(server, "acme") == 0
    assert cached_tokens(server, "acme") >= 64  # the same tenant reuses its own blocks
    assert cached_tokens(server, "globex") == 0
    # Naming the other tenant in the body does not help: only the gateway's header counts.
    assert cached_tokens(server, None, cache_salt="acme") == 0
    assert cached_tokens(server, "globex") >= 64


def test_the_key_is_nowhere_a_user_of_the_pod_can_look(server):
    for key in (KEY, WRONG_KEY, "sk-nothing"):
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": SERVED_NAME, "prompt": "a", "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert response.status_code == (200 if key == KEY else 401)
        assert key not in response.text
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert KEY not in metrics and WRONG_KEY not in metrics
    log = server.log()
    assert "DEBUG" in log  # the most talkative level was on
    assert KEY not in log and WRONG_KEY not in log
    # Read from a file: not on any command line, nor in any environment, of the pod's processes.
    api = psutil.Process(server.process.pid)
    for process in (api, *server.children().values()):
        assert KEY not in " ".join(process.cmdline())
        assert all(KEY not in value for value in process.environ().values())
