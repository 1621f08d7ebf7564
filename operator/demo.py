"""`tidegate demo`: run the tiny disaggregated LLMDeployment with `tidegate up`, ask it once.

`tidegate up` runs the pods the operator renders for the manifest (a prefill pod, a decode
pod and the router) as local processes; the demo waits for its public endpoint, sends one
chat request through the router, prints the answer and how to try more, and keeps serving
until Ctrl-C (which reaches `tidegate up`, and it stops every pod).
"""

from __future__ import annotations

import json
import urllib.request

from tidegate.common.local_server import LocalServer, tidegate_command

_STARTUP_DEADLINE_S = 300.0


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


def run_demo(model: str, port: int, manifest: str) -> int:
    """Run `manifest` with `model` on 127.0.0.1:`port` until Ctrl-C; up's exit code."""
    from tidegate.operator.manifest import load_llm_deployments

    name = load_llm_deployments(manifest)[0]["spec"]["model"]["name"]
    command = [*tidegate_command(), "up", "-f", manifest, "--model-dir", model]
    # Same session as us: Ctrl-C in the terminal reaches `tidegate up`, which stops its pods.
    server = LocalServer([*command, "--port", str(port)], port, own_session=False)
    base_url = server.base_url
    print("$", " ".join(server.command), flush=True)
    try:
        seconds = server.wait_healthy(_STARTUP_DEADLINE_S).startup_seconds or 0.0
        question = "What does a tidegate do?"
        answer = _chat(base_url, name, question)
        message = answer["choices"][0]["message"]["content"]
        print(f"\nhealthy after {seconds:.1f} s; the answer came through the router")
        print(f"user:      {question}")
        print(f"assistant: {message!r}  (random weights: the words are noise)")
        print(f"usage:     {answer['usage']}")
        print(
            f"\nIt keeps serving; try:\n"
            f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{name}", "messages": '
            f'[{{"role": "user", "content": "Hello"}}]}}\'\n'
            f"  curl {base_url}/metrics      # the router's; each pod's URL is in the table above\n"
            "Press Ctrl-C to stop.\n",
            flush=True,
        )
        return server.process.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached `tidegate up` too (same process group); it stops its pods and exits.
        return server.process.wait()
    except BaseException:
        server.stop()
        raise
