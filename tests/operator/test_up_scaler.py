"""`tidegate up`'s autoscaler over stand-in pods: what it reads, decides and turns on and off.

The processes are replaced by objects that answer `/health` and `/metrics` as an engine does;
tests/e2e/test_up_autoscaling.py runs the same with real processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.up import LocalPod, plan
from tidegate.operator.up_scaler import LocalAutoscaler, autoscaled_pools

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "autoscaling-tiny.yaml"


@dataclass
class _Process:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class _Server:
    process: _Process


class Fleet:
    """The answers of the pods and of the router, by URL."""

    def __init__(self) -> None:
        self.health: dict[str, int] = {}
        self.running: dict[str, int] = {}
        self.held = 0

    def fetch(self, url: str) -> httpx.Response:
        base, path = url.rsplit("/", 1)
        if base == ROUTER:
            body = f'tidegate:router_pending_requests{{pool="unified"}} {self.held}\n'
            return httpx.Response(200, text=body)
        if base not in self.health:
            raise httpx.ConnectError("connection refused")
        if path == "health":
            return httpx.Response(self.health[base])
        running = self.running.get(base, 0)
        body = (
            f'tidegate:num_requests_running{{engine="0",model_name="m"}} {running}\n'
            'tidegate:num_requests_waiting{engine="0",model_name="m"} 0\n'
            'tidegate:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
        )
        return httpx.Response(200, text=body)


ROUTER = "http://127.0.0.1:9000"


def _start(pod: LocalPod, fleet: Fleet, health: int = 200) -> None:
    """What the supervisor does with a pod turned on, and the pod answering."""
    pod.server = _Server(_Process())  # type: ignore[assignment]
    fleet.health[pod.url] = health


def _stop(pod: LocalPod, fleet: Fleet) -> None:
    pod.server = None
    fleet.health.pop(pod.url, None)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[list[LocalPod], LocalAutoscaler, Fleet, list[float]]:
    resource = load_llm_deployments(str(EXAMPLE))[0]
    pods, spec = plan(resource, Path("/m"), 9000, tmp_path)
    pools = autoscaled_pools(spec, pods)
    fleet, now = Fleet(), [0.0]
    scaler = LocalAutoscaler(pools, ROUTER, fetch=fleet.fetch, clock=lambda: now[0])
    engines = [pod for pod in pods if pod.role == "unified"]
    return engines, scaler, fleet, now


def test_the_example_plans_max_replicas_behind_a_router_all_off(tmp_path: Path) -> None:
    resource = load_llm_deployments(str(EXAMPLE))[0]
    pods, spec = plan(resource, Path("/m"), 9000, tmp_path)
    engines = [pod for pod in pods if pod.role == "unified"]
    [router] = [pod for pod in pods if pod.role == "router"]
    assert spec.autoscaling is not None and spec.autoscaling.unified is not None
    policy = spec.autoscaling.unified
    assert len(engines) == policy.max_replicas == 3
    assert not any(pod.active for pod in engines)  # minReplicas 0: it starts at zero
    assert router.active and router.port == 9000
    # The router knows every replica, running or not, and checks them every second.
    decode = router.command[router.command.index("--decode") + 1 :][:3]
    assert decode == [pod.url for pod in engines]
    assert router.command[router.command.index("--health-interval") + 1] == "1"


def test_a_request_held_at_zero_turns_one_replica_on_at_once(setup) -> None:
    engines, scaler, fleet, now = setup
    scaler.round()
    assert not any(pod.active for pod in engines)  # no demand: stays at zero
    fleet.held = 1
    now[0] = 1.0
    scaler.round()
    assert [pod.active for pod in engines] == [True, False, False]
    assert "held" in scaler.pools[0].last.reason or "wake" in scaler.pools[0].last.reason


def test_load_turns_on_more_and_a_starting_pod_counts_as_pending(setup) -> None:
    engines, scaler, fleet, now = setup
    engines[0].active = True
    _start(engines[0], fleet)
    fleet.running[engines[0].url] = 12  # three replicas' worth at requestsPerReplica 4
    now[0] = 1.0
    scaler.round()
    assert [pod.active for pod in engines] == [True, True, True]
    # The two new ones have started but do not answer /health yet: pending, not ready.
    for pod in engines[1:]:
        _start(pod, fleet, health=503)
    now[0] = 2.0
    decision = scaler.decide(scaler.pools[0], None, now[0])
    assert (decision.current, decision.desired) == (3, 3)
    assert scaler.pools[0].loads.keys() == {engines[0].name}


def test_a_scale_down_turns_off_the_idlest_replicas(setup) -> None:
    engines, scaler, fleet, now = setup
    for pod, running in zip(engines, (0, 3, 1), strict=True):
        pod.active = True
        _start(pod, fleet)
        fleet.running[pod.url] = running
    # Demand 4 asks for one replica; the scale-down window (10 s) and pace (1 per 5 s) hold.
    for second in range(0, 30):
        now[0] = float(second)
        scaler.round()
        for pod in engines:
            if not pod.active and pod.server is not None:
                _stop(pod, fleet)
    assert [pod.active for pod in engines] == [False, True, False]
    # The pod idlest first went first: the one with no request, then the one with one.


def test_a_pool_idle_for_idle_before_zero_goes_to_zero(setup) -> None:
    engines, scaler, fleet, now = setup
    engines[0].active = True
    _start(engines[0], fleet)
    for second in range(0, 45):
        now[0] = float(second)
        scaler.round()
        if not engines[0].active:
            break
    # idleBeforeZeroSeconds is 30 in the example.
    assert not engines[0].active and 30 <= now[0] < 32


def test_an_exited_pod_is_not_ready(setup) -> None:
    engines, scaler, fleet, _ = setup
    pod = engines[0]
    pod.active = True
    _start(pod, fleet)
    pod.server.process.code = 1  # type: ignore[union-attr]
    decision = scaler.decide(scaler.pools[0], None, 1.0)
    assert decision.current == 1 and not scaler.pools[0].loads  # pending: it restarts
