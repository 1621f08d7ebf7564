"""The engine config the operator renders is one `tidegate serve` runs as it is."""

from __future__ import annotations

import httpx

from tests.e2e.server import ServerProcess, rendered_config


def test_a_server_started_from_the_rendered_config_serves_as_configured(tiny_llama_dir, tmp_path):
    resource = {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {
            "model": {
                "name": "from-operator",
                "source": {"hostPath": {"path": str(tiny_llama_dir)}},
            }
        },
    }
    config = rendered_config(resource, "unified", tmp_path)
    server = ServerProcess(tiny_llama_dir, tmp_path, "--config", str(config))
    try:
        server.wait_healthy()
        models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["from-operator"]
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "from-operator", "prompt": "tide", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert "vllm:num_requests_running" in metrics  # the config's metrics-compat: vllm
    finally:
        server.stop()
