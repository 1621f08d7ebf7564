"""The operator's autoscaler: `decide()` over a cluster's pods, for `driver: operator`.

One asyncio task per LLMDeployment that has a policy and the default driver. Every period
(`--autoscale-period`, 15 s) it reads the resource afresh and, for each autoscaled pool:

1. lists the pods of the pool's Deployment by its selector labels. A pod whose Ready
   condition is true is scraped at `http://<podIP>:<http port>/metrics`; one that is not,
   or whose scrape fails, counts as pending this period, as do replicas the ReplicaSet has
   not made a pod for yet. The router's pods give `tidegate:router_pending_requests{pool}`,
   summed over its replicas. A pod's start time is measured from its creationTimestamp to
   its Ready condition's lastTransitionTime (the median over the pool's ready pods);
2. calls `decide()` with those signals (a rollout runs while the Deployment controller has
   not seen its latest generation or pods of an older template are left);
3. when the decision lowers the replicas, first sets `controller.kubernetes.io/pod-deletion-cost`
   on the ready pods to their running plus waiting requests, so that the ReplicaSet removes
   the idlest; then sets the Deployment's `spec.replicas` by server-side apply under its own
   field manager, `tidegate-autoscaler` (the reconcile leaves that field to it), and posts a
   `Scaled` Event on the LLMDeployment;
4. writes `status.autoscaling.<role>` (desired, current, reason, lastScaleTime, and the state
   a restarted operator needs: the scale-down window's recommendations, the recent scale
   events, the idle clock and the measured start time) when the decision or its reason
   changed, and nothing otherwise; the gauge `tidegate:autoscaler_desired_replicas` carries
   the desired replicas.

A refused API call or a failed scrape is logged and tried again the next period; nothing
here stops the operator. The task ends when the resource is gone or no longer has a policy
that the operator drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Gauge

from tidegate.operator.autoscaler import (
    Decision,
    ScaleEvent,
    ScalerState,
    decide,
    pool_targets,
)
from tidegate.operator.events import post_event, resource_event, rfc3339
from tidegate.operator.kube import AUTOSCALER_FIELD_MANAGER, Kube
from tidegate.operator.labels import selector_labels
from tidegate.operator.pool_metrics import (
    EngineLoad,
    PoolReading,
    engine_load,
    parse_exposition,
    router_pending,
)
from tidegate.operator.reconcile import AUTOSCALING_STATUS_KEY, replicas_body
from tidegate.operator.render import deployment_name
from tidegate.operator.resource_tasks import ResourceTasks
from tidegate.operator.spec import (
    API_VERSION,
    KIND,
    AutoscalingPolicy,
    LLMDeploymentSpec,
    SpecError,
    parse_spec,
)
from tidegate.operator.status import role_state

logger = logging.getLogger("tidegate.autoscaler")

PERIOD_S = 15.0
# A scrape slower than this counts the pod as not ready this period.
SCRAPE_TIMEOUT_S = 5.0
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SCALED_REASON = "Scaled"
COMPONENT = "tidegate-autoscaler"
# Scale events kept in status: enough for any rate-limit period and the cooldown.
MAX_EVENTS_KEPT = 10
# Keys of a status entry that some decisions leave out.
OPTIONAL_KEYS = ("lastScaleTime", "idleSince", "startTimeSeconds")

# URL of a `/metrics` -> its exposition, or None when it did not answer 200.
Fetch = Callable[[str], Awaitable[str | None]]


def operator_policies(resource: Mapping[str, Any]) -> dict[str, AutoscalingPolicy] | None:
    """The pools the operator's autoscaler drives, by role; None for a spec it refuses."""
    try:
        spec = parse_spec(resource.get("spec") or {})
    except SpecError:
        return None
    if spec.autoscaling is None or spec.autoscaling.driver != "operator":
        return {}
    return spec.autoscaling.policies()


# -- pods ----------------------------------------------------------------------------------


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return None


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's Ready condition is true and it is not being deleted."""
    ready = _condition(pod, "Ready")
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
    return ready is not None and ready.get("status") == "True" and not deleting


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """Where a pod serves `/metrics`: its IP and the port its containers name `http`."""
    ip = (pod.get("status") or {}).get("podIP")
    containers = (pod.get("spec") or {}).get("containers") or []
    ports = [p for c in containers for p in c.get("ports") or [] if p.get("name") == "http"]
    if not ip or not ports:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{ports[0]['containerPort']}/metrics"


def parse_time(text: str | None) -> float | None:
    """A Kubernetes time (RFC 3339) in seconds since the epoch; None when absent or unreadable."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def start_time_s(pod: Mapping[str, Any]) -> float | None:
    """Seconds from the pod's creation to its readiness; None while it is not ready."""
    if not is_ready(pod):
        return None
    created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    ready = parse_time((_condition(pod, "Ready") or {}).get("lastTransitionTime"))
    if created is None or ready is None:
        return None
    return max(0.0, ready - created)


class Scraper:
    """GETs pods' `/metrics` on a session of its own: the API server's credentials never go to
    a pod. `fetch` stands in for HTTP in tests."""

    def __init__(self, fetch: Fetch | None = None) -> None:
        self._fetch = fetch
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str) -> str | None:
        """The exposition at `url`, or None when it did not answer 200 in time."""
        if self._fetch is not None:
            return await self._fetch(url)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
            )
        try:
            async with self._session.get(url) as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def ready_pods(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        """The exposition of each ready pod that answered its scrape, by pod name."""
        ready = [(pod, url) for pod in pods if is_ready(pod) and (url := metrics_url(pod))]
        texts = await asyncio.gather(*(self(url) for _, url in ready))
        return {
            pod["metadata"]["name"]: text
            for (pod, _), text in zip(ready, texts, strict=True)
            if text is not None
        }

    async def close(self) -> None:
        """Release the connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def deletion_costs(loads: Mapping[str, EngineLoad]) -> dict[str, int]:
    """Each ready pod's deletion cost: its running plus waiting requests (idlest lowest)."""
    return {name: load.running + load.waiting for name, load in loads.items()}


# -- what status keeps ---------------------------------------------------------------------


def window_peaks(history: tuple[tuple[float, int], ...]) -> list[tuple[float, int]]:
    """The recommendations that may still be a window's highest later on: those that no
    later one equals or exceeds. As many as the distinct values at most; the scale-down
    window's highest at any later time is the same over these as over the whole history."""
    peaks: list[tuple[float, int]] = []
    for at, replicas in reversed(history):
        if not peaks or replicas > peaks[-1][1]:
            peaks.append((at, replicas))
    return peaks[::-1]


def status_entry(
    decision: Decision, policy: AutoscalingPolicy, start_s: float | None, now: float
) -> dict[str, Any]:
    """`status.autoscaling.<role>`: the decision and the state a restarted operator resumes."""
    state = decision.state
    period = max(policy.scale_up.period_seconds, policy.scale_down.period_seconds)
    events = [e for e in state.events if now - e.at < period] or list(state.events[-1:])
    entry: dict[str, Any] = {
        "desired": decision.desired,
        "current": decision.current,
        "reason": decision.reason,
    }
    if state.events:
        entry["lastScaleTime"] = rfc3339(state.events[-1].at)
    entry["recommendations"] = [
        {"at": math.floor(at), "replicas": replicas}
        for at, replicas in window_peaks(state.recommendations)
    ]
    entry["scaleEvents"] = [
        {"at": math.floor(e.at), "from": e.before, "to": e.after} for e in events[-MAX_EVENTS_KEPT:]
    ]
    if state.idle_since is not None:
        entry["idleSince"] = math.floor(state.idle_since)
    if start_s is not None:
        entry["startTimeSeconds"] = round(start_s)
    return entry


def restored_state(entry: Mapping[str, Any], now: float) -> ScalerState:
    """The ScalerState a restarted operator resumes from `status.autoscaling.<role>`.

    The last recommendation written held until the operator stopped (a new one would have
    changed the reason, and been written), so it is dated now: the scale-down window counts
    from the restart, never from an older write.
    """
    peaks = [(float(r["at"]), int(r["replicas"])) for r in entry.get("recommendations") or []]
    if peaks:
        peaks[-1] = (now, peaks[-1][1])
    events = tuple(
        ScaleEvent(float(e["at"]), int(e["from"]), int(e["to"]))
        for e in entry.get("scaleEvents") or []
    )
    idle = entry.get("idleSince")
    return ScalerState(
        recommendations=tuple(peaks),
        events=events,
        idle_since=float(idle) if idle is not None else None,
    )


def _shown(entry: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    """What decides whether status is written: the decision and its reason."""
    if entry is None:
        return None
    return entry.get("desired"), entry.get("current"), entry.get("reason")


# -- the loop ------------------------------------------------------------------------------


@dataclass
class _Pool:
    """What the loop keeps for one pool between periods."""

    state: ScalerState
    reading: PoolReading = field(default_factory=PoolReading)
    start_time_s: float | None = None
    written: dict[str, Any] | None = None


class ClusterAutoscaler(ResourceTasks):
    """Runs one autoscaling task per LLMDeployment that the operator's driver scales."""

    what = "autoscaler"
    look_now = False

    def __init__(
        self,
        kube: Kube,
        period_s: float = PERIOD_S,
        fetch: Fetch | None = None,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(kube, period_s, logger)
        self.clock = clock
        self._scrape = Scraper(fetch)
        self.registry = registry or CollectorRegistry()
        self.desired = Gauge(
            "tidegate:autoscaler_desired_replicas",
            "Replicas the operator's autoscaler wants for an LLMDeployment's pool.",
            ["namespace", "llmdeployment", "role"],
            registry=self.registry,
        )
        self.pools: dict[tuple[str, str, str], _Pool] = {}

    # -- the tasks (operator/resource_tasks.py) ---------------------------------------------

    def wants(self, resource: Mapping[str, Any]) -> bool:
        """Whether the operator drives a policy of it, or its status still holds an entry of
        one: a policy dropped while no operator ran leaves its entry, which one pass clears."""
        policies = operator_policies(resource)
        stale = policies == {} and (resource.get("status") or {}).get(AUTOSCALING_STATUS_KEY)
        return bool(policies or stale)

    async def close(self) -> None:
        """Stop every task and release the scrape connections."""
        await super().close()
        await self._scrape.close()

    def ended(self, namespace: str, name: str) -> None:
        """Its pools go, with their state and gauges."""
        for key in [k for k in self.pools if k[:2] == (namespace, name)]:
            self.pools.pop(key)
            self._drop_gauge(*key)

    def _drop_gauge(self, namespace: str, name: str, role: str) -> None:
        with contextlib.suppress(KeyError):  # never set: its pool had no Deployment yet
            self.desired.remove(namespace, name, role)

    # -- one period --------------------------------------------------------------------------

    async def step(self, resource: Mapping[str, Any]) -> bool:
        """One period for one resource; False when there is nothing left to drive."""
        meta = resource["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        policies = operator_policies(resource)
        if policies is None:
            return False  # a refused spec: the pools keep their replicas until it is fixed
        previous = (resource.get("status") or {}).get(AUTOSCALING_STATUS_KEY) or {}
        # Pools no longer autoscaled lose their entry, their state and their gauge.
        patch: dict[str, Any] = {role: None for role in previous if role not in policies}
        for key in [k for k in self.pools if k[:2] == (namespace, name)]:
            if key[2] not in policies:
                self.pools.pop(key)
                self._drop_gauge(*key)
        if policies:
            spec = parse_spec(resource.get("spec") or {})
            held = await self._router_held(namespace, name, spec)
            for role, policy in policies.items():
                entry = await self._scale_pool(resource, spec, role, policy, held, previous)
                if entry is not None:
                    patch[role] = entry
        if patch:
            body = {AUTOSCALING_STATUS_KEY: patch if policies else None}
            await self.kube.patch_status(API_VERSION, KIND, namespace, name, body)
        return bool(policies)

    async def _scale_pool(
        self,
        resource: Mapping[str, Any],
        spec: LLMDeploymentSpec,
        role: str,
        policy: AutoscalingPolicy,
        held: dict[str, int],
        previous: Mapping[str, Any],
    ) -> dict[str, Any] | None:
        """Read, decide and act on one pool; its status entry when that is to be written."""
        meta = resource["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        deployment = await self.kube.get(
            "apps/v1", "Deployment", namespace, deployment_name(name, role)
        )
        if deployment is None:
            return None  # the reconcile has not made it yet
        now = self.clock()
        key = (namespace, name, role)
        pool = self.pools.get(key)
        if pool is None:
            before = previous.get(role) or {}
            pool = _Pool(restored_state(before, now), written=dict(before) or None)
            start = before.get("startTimeSeconds")
            pool.start_time_s = float(start) if start is not None else None
            self.pools[key] = pool

        replicas = (deployment.get("spec") or {}).get("replicas", 1)
        pods = await self.kube.list("v1", "Pod", namespace, selector_labels(name, role))
        loads = await self._loads(pods)
        measured = [t for pod in pods if (t := start_time_s(pod)) is not None]
        if measured:
            pool.start_time_s = statistics.median(measured)
        live = role_state(role, replicas, deployment)
        slo = spec.scheduling.slo
        targets = pool_targets(policy, role, spec.scheduling.max_num_seqs, slo.ttft_ms, slo.itl_ms)
        signals = pool.reading.signals(
            role,
            loads,
            pending=0,
            router_held=held.get(role, 0),
            start_time_s=pool.start_time_s,
            rollout=not live.observed or live.old > 0,
        )
        # The pool is the replicas asked for: those without a ready, answering pod are
        # pending; a pod beyond them (one going away, a rollout's surge) adds load, not size.
        signals = replace(signals, ready=min(signals.ready, replicas))
        signals = replace(signals, pending=replicas - signals.ready)
        decision = decide(policy, targets, signals, pool.state, now)
        pool.state = decision.state
        if decision.desired != replicas:
            if decision.desired < replicas:
                await self._set_deletion_costs(namespace, pods, loads)
            await self.kube.apply(
                replicas_body(deployment, decision.desired), AUTOSCALER_FIELD_MANAGER
            )
            logger.info(f"autoscaler {namespace}/{name} {role}: {decision.reason}")
            await self._post_event(resource, role, decision, now)
        self.desired.labels(namespace, name, role).set(decision.desired)
        entry = status_entry(decision, policy, pool.start_time_s, now)
        if _shown(entry) == _shown(pool.written):
            return None
        pool.written = entry
        # A merge patch: keys this entry no longer has are cleared, not left from before.
        return {**{key: None for key in OPTIONAL_KEYS}, **entry}

    async def _loads(self, pods: list[dict[str, Any]]) -> dict[str, EngineLoad]:
        """The load of each ready pod that answered its scrape, by pod name."""
        texts = await self._scrape.ready_pods(pods)
        return {name: engine_load(parse_exposition(text)) for name, text in texts.items()}

    async def _router_held(
        self, namespace: str, name: str, spec: LLMDeploymentSpec
    ) -> dict[str, int]:
        """Requests the router's replicas hold, by pool; empty without a router."""
        if not spec.has_router():
            return {}
        pods = await self.kube.list("v1", "Pod", namespace, selector_labels(name, "router"))
        texts = (await self._scrape.ready_pods(pods)).values()
        samples = [s for text in texts for s in parse_exposition(text)]
        return {role: router_pending(samples, role) for role in ("unified", "prefill", "decode")}

    async def _set_deletion_costs(
        self, namespace: str, pods: list[dict[str, Any]], loads: Mapping[str, EngineLoad]
    ) -> None:
        """Annotate each ready pod with its cost, so that the ReplicaSet removes the idlest
        (pods not ready go first anyway: the ReplicaSet ranks them before any cost)."""
        costs = deletion_costs(loads)
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if pod_name not in costs:
                continue
            cost = str(costs[pod_name])
            if (pod["metadata"].get("annotations") or {}).get(DELETION_COST) == cost:
                continue
            patch = {"metadata": {"annotations": {DELETION_COST: cost}}}
            await self.kube.merge_patch("v1", "Pod", namespace, pod_name, patch)

    async def _post_event(
        self, resource: Mapping[str, Any], role: str, decision: Decision, now: float
    ) -> None:
        event = resource_event(
            resource,
            type="Normal",
            reason=SCALED_REASON,
            message=f"{role}: {decision.reason}",
            component=COMPONENT,
            now=now,
        )
        await post_event(self.kube, event, logger)
