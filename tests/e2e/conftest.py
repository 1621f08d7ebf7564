"""One shared server for the client-behaviour tests; the fault tests start their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import ServerProcess, serving

API_KEY = "test-key"
SERVED_NAME = "tiny"
# What the e2e clients expect of a server: its model name, key and metric names.
CLIENT_FLAGS = (
    "--served-model-name",
    SERVED_NAME,
    "--api-key",
    API_KEY,
    "--metrics-compat",
    "vllm",
)
# The shared server's flags; a test that needs the same server with one setting changed
# starts its own with these and that setting.
SHARED_SERVER_FLAGS = (*CLIENT_FLAGS, "--max-model-len", "512")


@pytest.fixture(scope="session")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """`tidegate serve` on the tiny Llama, with an API key and vLLM metric names."""
    proc = ServerProcess(tiny_llama_dir, tmp_path_factory.mktemp("logs"), *SHARED_SERVER_FLAGS)
    yield from serving(proc)
