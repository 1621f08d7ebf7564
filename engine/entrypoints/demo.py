"""`tidegate demo`: start `tidegate serve` as a pod would, ask it one question, keep serving.

"As a pod would": the server reads the engine config file that the operator renders for a
unified LLMDeployment of this model (the ConfigMap key `unified.yaml`); only the model folder,
the address and the port are given on the command line, as local stand-ins for the pod's.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path

from tidegate.engine.bench.local_server import LocalServer, serve_command

_STARTUP_DEADLINE_S = 120.0


def _chat(base_url: str, model: str, question: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 32,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def pod_config(model: str, name: str, directory: Path) -> Path:
    """Write the engine config the operator renders for a unified LLMDeployment of `model`."""
    from tidegate.operator.render import render

    resource = {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {
            "model": {"name": name, "source": {"hostPath": {"path": str(Path(model).resolve())}}}
        },
    }
    config_map = next(o for o in render(resource).objects if o["kind"] == "ConfigMap")
    path = directory / "unified.yaml"
    path.write_text(config_map["data"]["unified.yaml"])
    return path


def run_demo(model: str, port: int, name: str) -> int:
    """Serve `model` on 127.0.0.1:`port` until Ctrl-C; returns the server's exit code."""
    config = pod_config(model, name, Path(tempfile.mkdtemp(prefix="tidegate-demo-")))
    flags = ("--config", str(config))
    # Same session as us: Ctrl-C in the terminal reaches the server too, which drains and exits.
    server = LocalServer(serve_command(model, *flags, port=port), port, own_session=False)
    base_url = server.base_url
    print(f"# {config}: the engine config the operator renders for a unified LLMDeployment")
    print("$", " ".join(server.command), flush=True)
    try:
        seconds = server.wait_healthy(_STARTUP_DEADLINE_S).startup_seconds or 0.0
        question = "What does a tidegate do?"
        answer = _chat(base_url, name, question)
        message = answer["choices"][0]["message"]["content"]
        print(f"\nhealthy after {seconds:.1f} s")
        print(f"user:      {question}")
        print(f"assistant: {message!r}  (random weights: the words are noise)")
        print(f"usage:     {answer['usage']}")
        print(
            f"\nThe server keeps serving; try:\n"
            f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{name}", "messages": '
            f'[{{"role": "user", "content": "Hello"}}]}}\'\n'
            f"  curl {base_url}/metrics\n"
            "Press Ctrl-C to stop.\n",
            flush=True,
        )
        return server.process.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the server too (same process group); it drains and exits.
        return server.process.wait()
    except BaseException:
        server.stop()
        raise
