"""`tidegate demo`: start `tidegate serve` as a pod would, ask it one question, keep serving."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

_STARTUP_DEADLINE_S = 120.0


def _tidegate_command() -> list[str]:
    script = Path(sys.executable).parent / "tidegate"
    if script.exists():
        return [str(script)]
    found = shutil.which("tidegate")
    return [found] if found else [sys.executable, "-m", "tidegate.engine.entrypoints.cli"]


def _wait_healthy(server: subprocess.Popen, base_url: str) -> float:
    """Seconds until /health answers 200; raises if the server exits or the deadline passes."""
    started = time.monotonic()
    while time.monotonic() - started < _STARTUP_DEADLINE_S:
        if server.poll() is not None:
            raise RuntimeError(f"tidegate serve exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"tidegate serve was not healthy within {_STARTUP_DEADLINE_S:.0f} s")


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


def run_demo(model: str, port: int, name: str) -> int:
    """Serve `model` on 127.0.0.1:`port` until Ctrl-C; returns the server's exit code."""
    base_url = f"http://127.0.0.1:{port}"
    command = [*_tidegate_command(), "serve", "--model", model, "--served-model-name", name]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    print("$", " ".join(command), flush=True)
    server = subprocess.Popen(command)
    try:
        seconds = _wait_healthy(server, base_url)
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
        return server.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the server too (same process group); it drains and exits.
        return server.wait()
    except BaseException:
        server.terminate()
        server.wait()
        raise
