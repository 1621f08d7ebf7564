"""`tidegate up`'s canary (operator/up_rollout.py) without processes: the pods plan() makes,
each given a stand-in process and a `/metrics` page, and a manifest saved on disk.

What the real processes show (tests/e2e/test_up_canary.py) is the whole path; these show the
decisions: which file the canary reads, what a rollback leaves, what is not tried again, and
a closed-loop proposal tried as a canary.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from tests.operator.test_canary_e2e import page
from tests.operator.test_step_fit import run_steps
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.operator.canary_judge import CANARY_WARMUP_REQUESTS as WARM
from tidegate.operator.up import LocalConfig, LocalPod, local_config_dir, plan
from tidegate.operator.up_rollout import LocalRollout

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "canary-tiny.yaml"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Machine:
    """The pods of one plan, each 'running' with a page at its URL."""

    def __init__(self, tmp_path: Path, resource: dict[str, Any]) -> None:
        self.workdir = tmp_path / "work"
        self.pods, _ = plan(resource, tmp_path / "model", 8000, self.workdir)
        self.pages: dict[str, str] = {}
        for pod in self.pods:
            pod.server = SimpleNamespace(process=SimpleNamespace(poll=lambda: None, pid=1))
            self.pages[pod.url] = page(0, 0.2, 0.04)

    def pod(self, name: str) -> LocalPod:
        (found,) = [p for p in self.pods if p.name == name]
        return found

    def fetch(self, url: str) -> httpx.Response:
        base, _, path = url.rpartition("/")
        if path == "health":
            return httpx.Response(200, text="ok")
        return httpx.Response(200, text=self.pages[base])

    def config(self, key: str) -> dict[str, Any]:
        return yaml.safe_load((local_config_dir(self.workdir) / key).read_text())


def resource(**spec: Any) -> dict[str, Any]:
    loaded = yaml.safe_load(EXAMPLE.read_text())
    loaded["spec"].update(spec)
    return loaded


@pytest.fixture
def clock() -> Clock:
    return Clock()


def rollout_of(
    tmp_path: Path, machine: Machine, first: dict[str, Any], clock: Clock
) -> LocalRollout:
    file = tmp_path / "manifest.yaml"
    file.write_text(yaml.safe_dump(first))
    config = LocalConfig(local_config_dir(machine.workdir), tmp_path / "s", tmp_path / "c")
    return LocalRollout(file, first, machine.pods, config, fetch=machine.fetch, clock=clock)


def save(rollout: LocalRollout, resource: dict[str, Any]) -> None:
    rollout.file.write_text(yaml.safe_dump(resource))


def test_a_saved_change_runs_on_the_canary_and_a_slower_one_is_rolled_back(
    tmp_path: Path, clock: Clock
) -> None:
    first = resource()
    machine = Machine(tmp_path, first)
    canary, stable = machine.pod("tiny-canary-canary"), machine.pod("tiny-canary-0")
    assert canary.track == "canary" and not canary.active
    assert canary.command[canary.command.index("--config") + 1].endswith("unified-canary.yaml")
    rollout = rollout_of(tmp_path, machine, first, clock)
    rollout.poll()  # the manifest as up started: nothing to try
    assert rollout.trial is None and not canary.active

    save(rollout, resource(scheduling={"maxNumSeqs": 64}))
    rollout.poll()
    assert rollout.trial is not None and canary.active
    config = machine.config("unified-canary.yaml")
    assert config["max-num-seqs"] == 64 and config["track"] == "canary"
    assert config["traffic-weight"] == 0.5
    assert machine.config("unified.yaml").get("max-num-seqs") != 64

    machine.pages[canary.url] = page(WARM, 0.2, 0.08)
    rollout.poll()  # ready; the windows begin
    machine.pages[canary.url] = page(WARM + 30, 0.2, 0.08)  # ITL doubled
    machine.pages[stable.url] = page(60, 0.2, 0.04)
    rollout.poll()
    assert rollout.trial is None and not canary.active
    assert rollout.rolled_back is not None
    assert machine.config("unified.yaml").get("max-num-seqs") != 64

    # Saved again with the same change: held, not tried again.
    rollout.file.write_text(rollout.file.read_text() + "\n")
    rollout.poll()
    assert rollout.trial is None and not canary.active


def test_a_closed_loop_proposal_is_tried_on_the_canary(tmp_path: Path, clock: Clock) -> None:
    first = resource(
        tuning={"mode": "closed-loop", "windowSeconds": 10},
        scheduling={"slo": {"ttftMs": 2000, "itlMs": 50}},
    )
    machine = Machine(tmp_path, first)
    canary, stable = machine.pod("tiny-canary-canary"), machine.pod("tiny-canary-0")
    metrics = PrometheusMetrics("tiny", num_engines=1)
    machine.pages[stable.url] = metrics.render()[0].decode()
    rollout = rollout_of(tmp_path, machine, first, clock)
    rollout.poll()  # the window's first reading
    run_steps(metrics, random.Random(0), 3000)
    machine.pages[stable.url] = metrics.render()[0].decode()
    clock.now += 5
    rollout.poll()
    assert rollout.trial is None  # the window is not over
    clock.now += 6
    rollout.poll()
    assert rollout.trial is not None and canary.active
    (proposed,) = rollout.trial.proposed.values()
    assert proposed.threshold % 16 == 0 and "ITL 50 ms" in proposed.reason
    config = machine.config("unified-canary.yaml")
    assert config["long-prefill-token-threshold"] == proposed.threshold
    assert machine.config("unified.yaml")["long-prefill-token-threshold"] == "auto"

    # Rolled back: the threshold is remembered and not proposed again.
    machine.pages[canary.url] = page(WARM, 0.2, 0.04)
    machine.pages[stable.url] = page(0, 0.2, 0.04)
    rollout.poll()
    machine.pages[canary.url] = page(WARM + 30, 0.2, 0.04, failed=12)
    machine.pages[stable.url] = page(60, 0.2, 0.04)
    rollout.poll()
    assert rollout.trial is None and not canary.active
    assert rollout.rejected == {"unified": [proposed.threshold]}
    assert rollout.rolled_back is None  # a proposal, not a change of the manifest


def test_the_canary_serves_until_the_router_routes_to_the_restarted_pods_again(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Promoted: the stable pod restarts while the canary serves. The router marked the pod
    # down while it restarted and finds it back only at its next check; turning the canary
    # off before then would leave the router nothing to send requests to (503s).
    first = resource()
    machine = Machine(tmp_path, first)
    canary, stable = machine.pod("tiny-canary-canary"), machine.pod("tiny-canary-0")
    (router,) = [p for p in machine.pods if p.role == "router"]
    rollout = rollout_of(tmp_path, machine, first, clock)
    rollout.poll()
    save(rollout, resource(scheduling={"maxNumSeqs": 64}))
    rollout.poll()
    machine.pages[canary.url] = page(WARM, 0.2, 0.04)
    rollout.poll()  # ready; the windows begin
    machine.pages[canary.url] = page(WARM + 60, 0.2, 0.04)  # as fast as the stable pod
    machine.pages[stable.url] = page(60, 0.2, 0.04)

    checks: list[tuple[float, bool]] = []  # (the router's view of the pod, canary on)

    def fetch(url: str) -> httpx.Response:
        if url == f"{router.url}/metrics":
            seen = 1.0 if len(checks) >= 3 else 0.0  # back at the router's third check
            checks.append((seen, canary.active))
            other = 'tidegate:router_backend_up{role="unified",url="http://127.0.0.1:1"} 0.0'
            mine = f'tidegate:router_backend_up{{role="unified",url="{stable.url}"}} {seen}'
            return httpx.Response(200, text=f"{other}\n{mine}\n")
        return machine.fetch(url)

    def supervise(_seconds: float) -> None:
        """The supervisor's part, at each wait: a pod turned off stops, one on starts."""
        if not stable.active:
            stable.server = None
        elif stable.server is None:
            stable.server = SimpleNamespace(process=SimpleNamespace(poll=lambda: None, pid=2))

    monkeypatch.setattr("tidegate.operator.up_rollout.time.sleep", supervise)
    rollout._fetch = fetch
    rollout.poll()

    assert rollout.trial is None and rollout.rolled_back is None  # promoted
    assert machine.config("unified.yaml")["max-num-seqs"] == 64
    assert stable.active and stable.server is not None and not canary.active
    assert [seen for seen, _ in checks] == [0.0, 0.0, 0.0, 1.0]
    assert all(on for _, on in checks)  # the canary served through every check
