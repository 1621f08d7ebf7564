"""The rollout controller: judges a running canary, and promotes it or rolls it back.

While `status.rollout.phase` is Canary (the reconcile's `stage` put a canary pod of each
changed role beside the stable ones), one task per resource (operator/resource_tasks.py)
looks every period (`--rollout-period`, 15 s) and at once after each reconcile:

1. It scrapes the ready pods of each changed role: the canary's (track label, and the
   canary revision annotation, so a pod of an earlier canary is never counted) and the
   stable ones. A stable pod counts from its first scrape of this canary, a canary pod from
   its first scrape after its warm-up (`operator/canary_judge.py`). What counts: the TTFT
   and ITL histograms, finished requests and failed ones (`operator/pool_metrics.py`).
2. At each look (`CanaryPolicy.look_index` of the canary's requests: 100, 200, 400, 800 by
   default), `canary.compare` decides: promote, roll back, or wait. Every changed role must
   be promoted for the change to be; one rolled back rolls the change back. A canary pod
   that restarted is rolled back at once, and so is a canary not judged good enough within
   `timeoutSeconds`.
3. Promote: `status.rollout.stableSpec` := the spec; the reconcile then rolls the stable pods
   to it, surge-first, and deletes the canary. Roll back: `status.rollout.rolledBack` :=
   the canary's revision and the reason; the reconcile deletes the canary and keeps the
   stable pods until the spec changes again. Each writes an Event on the resource and
   `status.canaryAnalysis` (what was compared, and the verdict).

The annotation `tidegate.dev/canary: promote` or `abort` decides by hand (promote also
applies a change that was rolled back); the controller removes it once done. The windows
live in memory: an operator that restarts begins the canary's windows again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tidegate.operator.canary import Verdict
from tidegate.operator.canary_judge import CanaryState, Reading, policy_of
from tidegate.operator.closed_loop import (
    THRESHOLD,
    TUNED_ROLES,
    TUNING_STATUS_KEY,
    RoleWindow,
    closed_loop,
    look,
    tuning_inputs,
)
from tidegate.operator.cluster_scaler import PERIOD_S, Fetch, Scraper, parse_time
from tidegate.operator.events import post_event, resource_event, rfc3339
from tidegate.operator.kube import Kube
from tidegate.operator.labels import selector_labels
from tidegate.operator.pool_metrics import engine_load, parse_exposition
from tidegate.operator.reconcile import CANARY_ANALYSIS_STATUS_KEY, ROLLOUT_STATUS_KEY
from tidegate.operator.render import RenderOptions, render
from tidegate.operator.resource_tasks import ResourceTasks
from tidegate.operator.rollout import CANARY_ANNOTATION, CANARY_REVISION, is_canary
from tidegate.operator.spec import API_VERSION, KIND, LLMDeploymentSpec, SpecError, parse_spec
from tidegate.operator.step_fit import parse_step_totals

logger = logging.getLogger("tidegate.rollout")
COMPONENT = "tidegate-rollout"

Reconcile = Callable[[str, str], Awaitable[None]]


class RolloutController(ResourceTasks):
    """One task per LLMDeployment whose change runs as a canary."""

    what = "rollout"

    def __init__(
        self,
        kube: Kube,
        period_s: float = PERIOD_S,
        fetch: Fetch | None = None,
        reconcile: Reconcile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(kube, period_s, logger)
        self._scrape = Scraper(fetch)
        self._reconcile = reconcile
        self._clock = clock
        self.canaries: dict[tuple[str, str], CanaryState] = {}
        # Closed-loop tuning's windows, by resource and role.
        self.windows: dict[tuple[str, str], dict[str, RoleWindow]] = {}

    def wants(self, resource: Mapping[str, Any]) -> bool:
        status = resource.get("status") or {}
        phase = (status.get(ROLLOUT_STATUS_KEY) or {}).get("phase")
        return phase == "Canary" or _annotation(resource) is not None or closed_loop(resource)

    async def close(self) -> None:
        await super().close()
        await self._scrape.close()

    async def step(self, resource: Mapping[str, Any]) -> bool:
        meta = resource["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        status = resource.get("status") or {}
        rollout = status.get(ROLLOUT_STATUS_KEY) or {}
        action = _annotation(resource)
        if action is not None:
            await self._by_hand(resource, rollout, action)
            return True
        canary = rollout.get("canary") or {}
        tuning = status.get(TUNING_STATUS_KEY) or {}
        if rollout.get("phase") != "Canary" or not canary.get("revision"):
            self.canaries.pop(key, None)
            if closed_loop(resource) and rollout.get("phase") == "Stable":
                await self._tune(resource, tuning)
                return True
            self.windows.pop(key, None)
            return closed_loop(resource)
        self.windows.pop(key, None)  # a new window once this canary is decided
        rolled_back = (rollout.get("rolledBack") or {}).get("revision") == canary["revision"]
        promoted = rollout.get("stableSpec") == resource.get("spec") and not tuning.get("proposed")
        if rolled_back or promoted:
            return True  # decided: the reconcile has yet to apply it
        try:
            spec = parse_spec(resource.get("spec") or {})
        except SpecError:
            return False  # the reconcile reports it; the canary keeps running meanwhile
        state = self.canaries.get(key)
        if state is None or state.revision != canary["revision"]:
            started = parse_time(canary.get("startedAt"))
            state = CanaryState(canary["revision"], started or self._clock())
            self.canaries[key] = state
        verdict, analysis = await self._judge(resource, spec, canary, state)
        previous = status.get(CANARY_ANALYSIS_STATUS_KEY)
        if verdict.decision == "wait":
            if analysis != previous:
                await self.kube.patch_status(
                    API_VERSION, KIND, key[0], key[1], {CANARY_ANALYSIS_STATUS_KEY: analysis}
                )
            return True
        await self.decide(resource, verdict, analysis)
        return True

    async def _judge(
        self,
        resource: Mapping[str, Any],
        spec: LLMDeploymentSpec,
        canary: Mapping[str, Any],
        state: CanaryState,
    ) -> tuple[Verdict, dict[str, Any]]:
        meta = resource["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        readings: dict[str, Reading] = {}
        restarted: list[str] = []
        for role in canary.get("roles") or []:
            pods = await self.kube.list("v1", "Pod", namespace, selector_labels(name, role))
            ours = [p for p in pods if is_canary(p) and _revision(p) == state.revision]
            theirs = [p for p in pods if not is_canary(p)]
            for pod in ours:
                count = _restarts(pod)
                first = state.restarts.setdefault(pod["metadata"]["name"], count)
                if count > first:
                    restarted.append(f"{pod['metadata']['name']} restarted {count - first} time(s)")
            loads = []
            for group in (ours, theirs):
                texts = await self._scrape.ready_pods(group)
                loads.append({pod: engine_load(parse_exposition(t)) for pod, t in texts.items()})
            readings[role] = Reading(canary=loads[0], stable=loads[1])
        tuning = bool(((resource.get("status") or {}).get(TUNING_STATUS_KEY) or {}).get("proposed"))
        return state.judge(
            policy_of(spec, tuning),
            readings,
            restarted=restarted,
            elapsed_s=self._clock() - state.started,
            timeout_s=spec.rollout.canary.timeout_seconds,
        )

    async def decide(
        self, resource: Mapping[str, Any], verdict: Verdict, analysis: dict[str, Any]
    ) -> None:
        """Promote or roll back the resource's change, say so, and have it reconciled."""
        meta = resource["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        rollout = (resource.get("status") or {}).get(ROLLOUT_STATUS_KEY) or {}
        revision = (rollout.get("canary") or {}).get("revision") or analysis.get("revision", "")
        now = rfc3339(self._clock())
        tuning = (resource.get("status") or {}).get(TUNING_STATUS_KEY) or {}
        proposed = tuning.get("proposed") or {}
        tuning_patch: dict[str, Any] = {"proposed": None} if proposed else {}
        if verdict.decision == "promote":
            patch: dict[str, Any] = {
                "stableSpec": resource.get("spec") or {},
                "stableGeneration": meta.get("generation"),
                "rolledBack": None,
                "lastPromoted": {"revision": revision, "reason": verdict.reason, "at": now},
            }
            reason, kind = "CanaryPromoted", "Normal"
            if proposed:
                tuning_patch["applied"] = {**(tuning.get("applied") or {}), **proposed}
        else:
            patch = {"rolledBack": {"revision": revision, "reason": verdict.reason, "at": now}}
            reason, kind = "CanaryRolledBack", "Warning"
            if proposed:
                rejected = dict(tuning.get("rejected") or {})
                for role, entry in proposed.items():
                    rejected[role] = [*rejected.get(role, []), entry.get(THRESHOLD)][-8:]
                tuning_patch["rejected"] = rejected
        body = {ROLLOUT_STATUS_KEY: patch, CANARY_ANALYSIS_STATUS_KEY: analysis}
        if tuning_patch:
            body[TUNING_STATUS_KEY] = tuning_patch
        await self.kube.patch_status(API_VERSION, KIND, namespace, name, body)
        self.canaries.pop((namespace, name), None)
        logger.info(f"{namespace}/{name}: {reason}: {verdict.reason}")
        await self.event(resource, kind, reason, f"revision {revision}: {verdict.reason}")
        if self._reconcile is not None:
            await self._reconcile(namespace, name)

    async def _tune(self, resource: Mapping[str, Any], tuning: Mapping[str, Any]) -> None:
        """Closed-loop tuning while the spec is stable: gather a window of each tuned role's
        step counters from its pods; at its end, fit and propose (operator/closed_loop.py)."""
        meta = resource["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if tuning.get("proposed"):
            return  # its canary is about to start
        try:
            applied, _ = tuning_inputs(resource)
            rendered = render(dict(resource), RenderOptions(), applied)
        except SpecError:
            return
        now = self._clock()
        windows = self.windows.setdefault(key, {})
        last_fit = dict(tuning.get("lastFit") or {})
        proposals: dict[str, Any] = {}
        for role in (r for r in TUNED_ROLES if r in rendered.tuning.roles):
            pods = await self.kube.list("v1", "Pod", key[0], selector_labels(key[1], role))
            texts = await self._scrape.ready_pods([p for p in pods if not is_canary(p)])
            readings = {pod: parse_step_totals(text) for pod, text in texts.items()}
            rejected = list((tuning.get("rejected") or {}).get(role) or [])
            looked = look(windows, rendered, role, readings, now, rejected)
            if looked is None:
                continue
            entry, last = looked
            last_fit[role] = {**last, "at": rfc3339(now)}
            if entry is not None:
                proposals[role] = entry
        if last_fit == (tuning.get("lastFit") or {}) and not proposals:
            return
        body: dict[str, Any] = {"lastFit": last_fit}
        if proposals:
            body["proposed"] = proposals
        await self.kube.patch_status(API_VERSION, KIND, key[0], key[1], {TUNING_STATUS_KEY: body})
        if proposals:
            said = "; ".join(f"{role}: {entry['reason']}" for role, entry in proposals.items())
            logger.info(f"{key[0]}/{key[1]}: closed-loop tuning proposes {said}")
            await self.event(resource, "Normal", "TuningProposed", said)
            if self._reconcile is not None:
                await self._reconcile(*key)

    async def _by_hand(
        self, resource: Mapping[str, Any], rollout: Mapping[str, Any], action: str
    ) -> None:
        meta = resource["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        # Removed first: a decision that fails half-way is not repeated by every later look.
        patch = {"metadata": {"annotations": {CANARY_ANNOTATION: None}}}
        await self.kube.merge_patch(API_VERSION, KIND, namespace, name, patch)
        phase = rollout.get("phase")
        canary = rollout.get("canary") or {}
        by_hand = f"by hand (annotation {CANARY_ANNOTATION}: {action})"
        analysis = {"revision": canary.get("revision", ""), "decision": action, "reason": by_hand}
        if action == "promote" and phase in ("Canary", "RolledBack"):
            await self.decide(resource, Verdict("promote", by_hand), analysis)
        elif action == "abort" and phase == "Canary":
            await self.decide(resource, Verdict("rollback", by_hand), analysis)
        else:
            message = f"{CANARY_ANNOTATION}: {action} ignored: no change is held back"
            if phase == "RolledBack":
                message = f"{CANARY_ANNOTATION}: abort ignored: the change is already rolled back"
            await self.event(resource, "Warning", "CanaryAnnotationIgnored", message)

    async def event(
        self, resource: Mapping[str, Any], kind: str, reason: str, message: str
    ) -> None:
        """An Event on the resource, as `kubectl describe` shows them."""
        event = resource_event(
            resource,
            type=kind,
            reason=reason,
            message=message,
            component=COMPONENT,
            now=self._clock(),
        )
        await post_event(self.kube, event, logger)


def _annotation(resource: Mapping[str, Any]) -> str | None:
    value = ((resource.get("metadata") or {}).get("annotations") or {}).get(CANARY_ANNOTATION)
    return value if value in ("promote", "abort") else None


def _revision(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(CANARY_REVISION)


def _restarts(pod: Mapping[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)
