"""`tidegate up` with `rollout.strategy: canary`, over real processes, under load: a change
that makes ITL much better is promoted (the stable pod restarts with it), and one that makes
it much worse is rolled back, with no failed request.

The change is parallelism.tensorParallelSize: at 2, the tiny model's two CPU ranks all-reduce
every layer over gloo, which makes each decode step several times slower than at 1 on this
machine (about 8.6 ms against 1.2 ms per token, one stream, 2 cores).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.test_up import stop_and_check_nothing_is_left, wait_serving
from tidegate.common.local_server import LocalServer, free_port, tidegate_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "canary-tiny.yaml"
DEADLINE_S = 240.0


def manifest(model_dir: Path, tensor_parallel: int) -> str:
    resource = yaml.safe_load(EXAMPLE.read_text())
    spec = resource["spec"]
    spec["model"]["source"] = {"hostPath": {"path": str(model_dir)}}
    spec["parallelism"] = {"tensorParallelSize": tensor_parallel}
    return yaml.safe_dump(resource, sort_keys=False)


class Load:
    """Clients sending completions through up's port until stopped, counting the answers."""

    def __init__(self, url: str, model: str, clients: int = 6, long_every: int = 0) -> None:
        self.url, self.model = url, model
        # Every long_every-th request of a client has a prompt of about 800 tokens.
        self.long_every = long_every
        self.answers: Counter[str] = Counter()
        self.failures: list[str] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self.stopping.is_set():
                n += 1
                prompt = f"client {index} asks question {n}:"
                if self.long_every and n % self.long_every == 0:
                    prompt += " ".join(f"{index}-{n}-{i}" for i in range(200))
                body = {
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "stream": n % 2 == 0,
                }
                try:
                    response = client.post(f"{self.url}/v1/completions", json=body)
                    text = response.text
                    ok = response.status_code == 200 and (
                        not body["stream"] or text.rstrip().endswith("data: [DONE]")
                    )
                    if not ok:
                        self.failures.append(f"{response.status_code} {text[:300]}")
                    self.answers[str(response.status_code)] += 1
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)


def wait_for_log(server: LocalServer, pattern: str, since: int) -> re.Match[str]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        found = re.search(pattern, server.log()[since:])
        if found:
            return found
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, f"no {pattern!r} within {DEADLINE_S} s\n{server.log()}"
        time.sleep(0.25)  # polling with a deadline


def test_a_faster_change_is_promoted_and_a_slower_one_rolled_back_without_a_failed_request(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    file = tmp_path / "canary.yaml"
    file.write_text(manifest(tiny_llama_dir, tensor_parallel=2))
    port = free_port()
    command = [*tidegate_command(), "up", "-f", str(file), "--port", str(port)]
    server = LocalServer(command, port, log=tmp_path / "up.log")
    load: Load | None = None
    model = yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["name"]
    try:
        wait_serving(server)
        load = Load(server.base_url, model)
        log_at: Callable[[], int] = lambda: len(server.log())  # noqa: E731

        # TP 1: much faster. The canary pod starts, is compared, promoted, and the stable
        # pod restarts with the new config while the canary serves.
        mark = log_at()
        file.write_text(manifest(tiny_llama_dir, tensor_parallel=1))
        started = wait_for_log(server, r"canary: revision (\w+) of unified starts", mark)
        revision = started.group(1)
        promoted = wait_for_log(server, rf"canary: revision {revision} promoted: (.*)", mark)
        assert "within 20%" in promoted.group(1)
        wait_for_log(server, rf"every unified pod runs revision {revision}", mark)
        config = yaml.safe_load((Path(_workdir(server)) / "config" / "unified.yaml").read_text())
        assert config["tensor-parallel-size"] == 1

        # Back to TP 2: much slower. Rolled back, and not tried again when saved again.
        mark = log_at()
        file.write_text(manifest(tiny_llama_dir, tensor_parallel=2))
        started = wait_for_log(server, r"canary: revision (\w+) of unified starts", mark)
        slower = started.group(1)
        rolled = wait_for_log(server, rf"canary: revision {slower} rolled back: (.*)", mark)
        assert "ITL" in rolled.group(1) and "slower" in rolled.group(1), rolled.group(1)
        config = yaml.safe_load((Path(_workdir(server)) / "config" / "unified.yaml").read_text())
        assert config["tensor-parallel-size"] == 1
        time.sleep(2)  # the router sees the canary drained, the clients keep going
        load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.answers["200"] > 80, load.answers
        log = server.log()
        assert "restart tidegate up" not in log
        assert not re.search(r"exited with code", log), log
    finally:
        if load is not None:
            load.stop()
        stop_and_check_nothing_is_left(server)


def _workdir(server: LocalServer) -> str:
    found = re.search(r"\(logs in ([^)]+)\)", server.log())
    assert found, server.log()
    return found.group(1)


def test_closed_loop_tuning_tries_its_proposal_on_a_canary_without_a_failed_request(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    resource = yaml.safe_load(manifest(tiny_llama_dir, tensor_parallel=1))
    resource["spec"]["tuning"] = {"mode": "closed-loop", "windowSeconds": 10}
    resource["spec"]["scheduling"] = {"slo": {"ttftMs": 2000, "itlMs": 20}}
    file = tmp_path / "tuned.yaml"
    file.write_text(yaml.safe_dump(resource, sort_keys=False))
    port = free_port()
    command = [*tidegate_command(), "up", "-f", str(file), "--port", str(port)]
    server = LocalServer(command, port, log=tmp_path / "up.log")
    load: Load | None = None
    try:
        wait_serving(server)
        # Long prompts beside short ones: steps with prompt chunks of several sizes, and
        # decode-only steps, which the fit needs to tell a prompt token's cost from the rest.
        load = Load(server.base_url, resource["spec"]["model"]["name"], long_every=3)
        fitted = wait_for_log(server, r"closed-loop: unified: (\d+) steps; (.*)", 0)
        assert int(fitted.group(1)) > 0
        started = wait_for_log(server, r"canary: revision (\w+) of unified starts", 0)
        decided = wait_for_log(
            server, rf"canary: revision {started.group(1)} (promoted|rolled back)", 0
        )
        if decided.group(1) == "promoted":
            wait_for_log(server, rf"every unified pod runs revision {started.group(1)}", 0)
        load.stop()
        assert load.failures == [], load.failures[:5]
        log = server.log()
        proposal = re.search(r"closed-loop: unified: \d+ steps; (threshold .*)", log)
        assert proposal, log
        assert not re.search(r"exited with code", log), log
    finally:
        if load is not None:
            load.stop()
        stop_and_check_nothing_is_left(server)
