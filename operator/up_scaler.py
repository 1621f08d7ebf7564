"""`tidegate up`'s autoscaler: the operator's decision, over local processes.

Each autoscaled pool is made of its policy's maxReplicas local pods, each with its own port,
all of them known to the router; those the pool does not run are turned off. Every period
the autoscaler reads each pool as the operator's loop reads a Deployment's pods: a pod
turned on that answers `/health` is ready, one that does not yet is pending; the ready
pods' `/metrics` and the router's `tidegate:router_pending_requests` give the load. The
pure `decide()` of `operator/autoscaler.py` says how many pods the pool should run; the
supervisor starts the pods turned on and drains those turned off (SIGTERM: the engine's
`/health` answers 503 at once, the router stops picking it, its requests finish). A
scale-down turns off the pods with the fewest running requests, as the operator's
pod-deletion cost makes the ReplicaSet do.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from tidegate.operator.autoscaler import (
    Decision,
    PoolTargets,
    ScalerState,
    decide,
    pool_targets,
)
from tidegate.operator.pool_metrics import (
    EngineLoad,
    PoolReading,
    engine_load,
    parse_exposition,
    router_pending,
)
from tidegate.operator.spec import AutoscalingPolicy, LLMDeploymentSpec

if TYPE_CHECKING:
    from tidegate.operator.up import LocalPod

logger = logging.getLogger("tidegate.up")

# How often the pools are read and decided on: the policies' windows are seconds long.
PERIOD_S = 1.0
# A scrape slower than this counts the pod as not ready this period.
SCRAPE_TIMEOUT_S = 2.0


@dataclass
class LocalPool:
    """One autoscaled pool: its pods (maxReplicas of them), policy and scaler state."""

    role: str
    policy: AutoscalingPolicy
    targets: PoolTargets
    pods: list[LocalPod]
    state: ScalerState = field(default_factory=ScalerState)
    reading: PoolReading = field(default_factory=PoolReading)
    loads: dict[str, EngineLoad] = field(default_factory=dict)
    start_times_s: list[float] = field(default_factory=list)
    ready_once: set[str] = field(default_factory=set)
    last: Decision | None = None

    @property
    def active(self) -> list[LocalPod]:
        return [pod for pod in self.pods if pod.active]

    def scale_to(self, desired: int) -> None:
        """Turn pods on (stopped ones, first by index) or off (the idlest) to reach `desired`."""
        active = self.active
        if desired > len(active):
            for pod in [p for p in self.pods if p.idle][: desired - len(active)]:
                pod.active = True
        elif desired < len(active):
            # The idlest first: fewest running requests; a pod not serving yet before all.
            def load(pod: LocalPod) -> int:
                found = self.loads.get(pod.name)
                return -1 if found is None else found.running + found.waiting

            for pod in sorted(active, key=load)[: len(active) - desired]:
                pod.active = False


def autoscaled_pools(spec: LLMDeploymentSpec, pods: list[LocalPod]) -> list[LocalPool]:
    """The pools of `spec` that have a policy, each with its pods (plan() made them)."""
    policies = spec.autoscaling.policies() if spec.autoscaling else {}
    slo = spec.scheduling.slo
    pools = []
    for role, policy in policies.items():
        members = [pod for pod in pods if pod.role == role and pod.track == "stable"]
        targets = pool_targets(policy, role, spec.scheduling.max_num_seqs, slo.ttft_ms, slo.itl_ms)
        pools.append(LocalPool(role, policy, targets, members))
    return pools


Fetch = Callable[[str], httpx.Response]


class LocalAutoscaler:
    """Reads every autoscaled pool each period, decides, and turns its pods on and off."""

    def __init__(
        self,
        pools: list[LocalPool],
        router_url: str | None,
        fetch: Fetch | None = None,
        period_s: float = PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pools = pools
        self.router_url = router_url
        self.period_s = period_s
        self.clock = clock
        self._client = httpx.Client(timeout=SCRAPE_TIMEOUT_S) if fetch is None else None
        self.fetch: Fetch = fetch or self._client.get  # type: ignore[union-attr]

    def run(self, stopping: threading.Event) -> None:
        """Until `stopping` is set: one round per period."""
        try:
            while not stopping.wait(self.period_s):
                self.round()
        finally:
            if self._client is not None:
                self._client.close()

    def round(self) -> None:
        """Read, decide and act on every pool once."""
        router = self._scrape(self.router_url) if self.router_url else None
        now = self.clock()
        for pool in self.pools:
            decision = self.decide(pool, router, now)
            if decision.changed:
                logger.info(
                    "autoscaler: %s %d -> %d (%s)",
                    pool.role,
                    decision.current,
                    decision.desired,
                    decision.reason,
                )
                pool.scale_to(decision.desired)

    def decide(self, pool: LocalPool, router: str | None, now: float) -> Decision:
        """One decision for `pool`, from its pods and the router's exposition (None: none)."""
        loads: dict[str, EngineLoad] = {}
        pending = 0
        for pod in pool.active:
            text = self._ready_metrics(pod)
            if text is None:
                pending += 1
                continue
            loads[pod.name] = engine_load(parse_exposition(text))
            if pod.name not in pool.ready_once:
                # The first time this run of the pod is seen ready: its start time.
                pool.ready_once.add(pod.name)
                pool.start_times_s.append(max(0.0, time.monotonic() - pod.started_at))
        for pod in pool.pods:
            if not pod.active:
                pool.ready_once.discard(pod.name)  # its next start is timed again
        pool.loads = loads
        held = router_pending(parse_exposition(router), pool.role) if router else 0
        start_time = statistics.median(pool.start_times_s) if pool.start_times_s else None
        signals = pool.reading.signals(pool.role, loads, pending, held, start_time)
        decision = decide(pool.policy, pool.targets, signals, pool.state, now)
        pool.state, pool.last = decision.state, decision
        return decision

    def _ready_metrics(self, pod: LocalPod) -> str | None:
        """The pod's exposition if it is running and ready (`/health` 200), else None."""
        if pod.server is None or pod.draining is not None or pod.exited() is not None:
            return None
        health = self._get(f"{pod.url}/health")
        if health is None or health.status_code != 200:
            return None
        return self._scrape(pod.url)

    def _scrape(self, url: str) -> str | None:
        response = self._get(f"{url}/metrics")
        return response.text if response is not None and response.status_code == 200 else None

    def _get(self, url: str) -> httpx.Response | None:
        try:
            return self.fetch(url)
        except httpx.HTTPError:
            return None
