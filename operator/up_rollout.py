"""`tidegate up` and `rollout.strategy: canary`: the operator's canary over local processes.

`plan()` gives every engine role one canary pod beside its replicas, turned off, whose
`--config` is `<role>-canary.yaml` and whose URL the router knows from the start. Every second
`LocalRollout` looks at the manifest; once it was saved with a change of a role's pods (the
operator's `stage` against the last promoted manifest says which roles, and the change's
revision), it:

1. writes the canary's config file as the ConfigMap would hold it (the new flags, `track:
   canary` and its `traffic-weight`), and turns the role's canary pod on;
2. once the canary answers `/health`, reads its `/metrics` and the role's other pods' every
   period, and judges them as the operator's rollout controller does (`CanaryState.judge`:
   the same windows, looks and tests);
3. promotes: writes the role's new config file, then restarts the role's pods one at a time
   (each drained first: its requests finish, the router sends new ones to the others,
   the canary included), and turns the canary off once they all serve again; or rolls back:
   turns the canary off and remembers the revision, which is not tried again until the
   manifest changes it.

A change that a canary cannot try (the strategy, the roles themselves, anything outside
the engine pods) is logged as needing a restart of up, as without the canary strategy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tidegate.operator.canary import Verdict
from tidegate.operator.canary_judge import CanaryState, Reading, policy_of
from tidegate.operator.closed_loop import TUNED_ROLES, RoleWindow, closed_loop, look, measured
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.pool_metrics import EngineLoad, engine_load, parse_exposition
from tidegate.operator.render import Rendered, RenderOptions, render
from tidegate.operator.rollout import CANARY_SUFFIX, rolled_roles, stage
from tidegate.operator.spec import SpecError
from tidegate.operator.step_fit import parse_step_totals
from tidegate.operator.tuning import MeasuredChunks
from tidegate.operator.up import LocalConfig, LocalPod
from tidegate.operator.up_adapters import manifest_state

logger = logging.getLogger("tidegate.up")

POLL_S = 1.0
# How long a pod may take to answer /health after it was started.
READY_TIMEOUT_S = 300.0

Fetch = Callable[[str], httpx.Response]


@dataclass
class Trial:
    """The change a canary runs now."""

    revision: str
    roles: tuple[str, ...]
    resource: dict[str, Any]
    rendered: Rendered
    state: CanaryState
    started: float
    # Each canary pod's restarts when the trial began: one more rolls the change back.
    restarts: dict[str, int]
    # The closed-loop values it tries, by role (none for a change of the manifest).
    proposed: dict[str, MeasuredChunks]
    ready: bool = False
    said: str = ""


class LocalRollout:
    """Runs each change of the manifest's engine pods on a canary first."""

    def __init__(
        self,
        file: Path,
        resource: dict[str, Any],
        pods: list[LocalPod],
        config: LocalConfig,
        fetch: Fetch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.file = file
        self.stable = resource
        self.pods = pods
        self.config = config
        self._fetch = fetch or (lambda url: httpx.get(url, timeout=5.0))
        self._clock = clock
        # Nothing seen yet: the first look reads the manifest, which may have been saved
        # since `resource` was read from it.
        self._seen: tuple[int, str] = (0, "")
        self.rolled_back: str | None = None
        self.trial: Trial | None = None
        self.latest: dict[str, Any] | None = None
        # Closed-loop tuning (operator/closed_loop.py), as status.tuning holds it in a cluster.
        self.applied: dict[str, MeasuredChunks] = {}
        self.rejected: dict[str, list[int]] = {}
        self.windows: dict[str, RoleWindow] = {}

    def run(self, stopping: threading.Event, poll_s: float = POLL_S) -> None:
        """poll() every `poll_s` until `stopping`."""
        while not stopping.wait(poll_s):
            try:
                self.poll(stopping)
            except Exception:
                logger.exception("canary: a look failed; next period")

    def _read_manifest(self) -> dict[str, Any] | None:
        """The manifest's resource once it was saved since the last look, else None."""
        try:
            saved = manifest_state(self.file)
        except OSError:
            return None  # an editor's save in progress; the next look sees it
        if saved == self._seen:
            return None
        self._seen = saved
        try:
            resources = load_llm_deployments(self.file)
            if len(resources) != 1:
                raise SpecError(f"{self.file} holds {len(resources)} LLMDeployments; up runs one")
            return resources[0]
        except SpecError as error:
            logger.error("%s: not applied (save it again to retry): %s", self.file, error)
            return None

    def poll(self, stopping: threading.Event | None = None) -> None:
        """One look at the manifest and at the canary running, if any."""
        saved = self._read_manifest()
        if saved is not None:
            self.latest = saved
            self._consider(saved)
        if self.trial is not None:
            self._judge(self.trial, stopping)
        elif closed_loop(self.stable) and self.latest in (None, self.stable):
            self._tune()

    def _consider(
        self, resource: dict[str, Any], proposed: Mapping[str, MeasuredChunks] | None = None
    ) -> None:
        """A manifest just saved, or a closed-loop proposal: start its canary, or say why none
        starts."""
        try:
            new = render(resource, RenderOptions(), {**self.applied, **(proposed or {})})
            stable = render(self.stable, RenderOptions(), self.applied)
        except SpecError as error:
            logger.error("%s: not applied (save it again to retry): %s", self.file, error)
            return
        traffic = new.spec.rollout.canary.traffic_percent
        staged = stage(new, stable, rolled_back=self.rolled_back, traffic_percent=traffic)
        if self.trial is not None:
            if staged.mode == "canary" and staged.revision == self.trial.revision:
                return  # the same change, saved again
            logger.info(
                "canary: the manifest changed again; stopping the canary of %s", self.trial.revision
            )
            self._turn_off_canaries(self.trial.roles)
            self.trial = None
        if staged.mode == "held":
            logger.warning(
                "canary: revision %s was rolled back; change the manifest to try again",
                staged.revision,
            )
            return
        if staged.mode == "direct":
            if rolled_roles(stable, new) != []:
                logger.warning(
                    "%s: the change is not one a canary can try (roles or strategy changed); "
                    "restart tidegate up to run it",
                    self.file,
                )
            return
        config_map = next(o for o in staged.objects if o["kind"] == "ConfigMap")
        for role in staged.roles:
            key = f"{role}{CANARY_SUFFIX}.yaml"
            self.config.write(key, config_map["data"][key])
        for pod in self._canaries(staged.roles):
            pod.active = True
        logger.info(
            "canary: revision %s of %s starts on a canary pod with %d%% of the requests",
            staged.revision,
            ", ".join(staged.roles),
            traffic,
        )
        state = CanaryState(staged.revision, self._clock())
        restarts = {pod.name: pod.restarts for pod in self._canaries(staged.roles)}
        self.trial = Trial(
            staged.revision,
            staged.roles,
            resource,
            new,
            state,
            self._clock(),
            restarts,
            dict(proposed or {}),
        )

    def _judge(self, trial: Trial, stopping: threading.Event | None) -> None:
        canaries = self._canaries(trial.roles)
        restarted = [
            f"{p.name} restarted {p.restarts - trial.restarts.get(p.name, 0)} time(s)"
            for p in canaries
            if p.restarts > trial.restarts.get(p.name, 0)
        ]
        if not trial.ready and not restarted:
            if not all(self._healthy(pod) for pod in canaries):
                if self._clock() - trial.started > READY_TIMEOUT_S:
                    self._decide(trial, Verdict("rollback", "the canary did not become ready"))
                return
            trial.ready = True
            trial.state.started = self._clock()
        readings = {
            role: Reading(
                canary=self._loads([p for p in canaries if p.role == role]),
                stable=self._loads(self._stable_pods(role)),
            )
            for role in trial.roles
        }
        spec = trial.rendered.spec
        verdict, analysis = trial.state.judge(
            policy_of(spec, tuning=bool(trial.proposed)),
            readings,
            restarted=restarted,
            elapsed_s=self._clock() - trial.state.started,
            timeout_s=spec.rollout.canary.timeout_seconds,
        )
        said = f"{verdict.decision}: {verdict.reason}"
        if said != trial.said:
            trial.said = said
            logger.info("canary: %s %s", _counts(analysis), said)
        if verdict.decision != "wait":
            self._decide(trial, verdict, stopping)

    def _decide(
        self, trial: Trial, verdict: Verdict, stopping: threading.Event | None = None
    ) -> None:
        self.trial = None
        self.windows.clear()  # a new window of steps once the change is decided
        if verdict.decision == "rollback":
            self._turn_off_canaries(trial.roles)
            if trial.proposed:
                for role, chunks in trial.proposed.items():
                    self.rejected.setdefault(role, []).append(chunks.threshold)
            else:
                self.rolled_back = trial.revision
            logger.warning("canary: revision %s rolled back: %s", trial.revision, verdict.reason)
            return
        logger.info("canary: revision %s promoted: %s", trial.revision, verdict.reason)
        config_map = next(o for o in trial.rendered.objects if o["kind"] == "ConfigMap")
        for role in trial.roles:
            self.config.write(f"{role}.yaml", config_map["data"][f"{role}.yaml"])
            # One at a time, the canary still serving: the role never runs short of a pod.
            for pod in self._stable_pods(role):
                if stopping is not None and stopping.is_set():
                    return
                self._restart(pod)
        self._turn_off_canaries(trial.roles)
        self.stable = trial.resource
        self.applied.update(trial.proposed)
        self.rolled_back = None
        logger.info("canary: every %s pod runs revision %s", "/".join(trial.roles), trial.revision)

    def _tune(self) -> None:
        """Closed-loop tuning: a window of each tuned role's step counters from its pods; at
        its end a fit, and a proposal tried as a canary (operator/closed_loop.py)."""
        rendered = render(self.stable, RenderOptions(), self.applied)
        now = self._clock()
        proposals: dict[str, Any] = {}
        for role in (r for r in TUNED_ROLES if r in rendered.tuning.roles):
            readings = {
                name: parse_step_totals(text)
                for name, text in self._pages(self._stable_pods(role)).items()
            }
            looked = look(self.windows, rendered, role, readings, now, self.rejected.get(role, []))
            if looked is None:
                continue
            entry, last = looked
            logger.info("closed-loop: %s: %s steps; %s", role, last["steps"], last["proposal"])
            if entry is not None:
                proposals[role] = entry
        if proposals:
            self._consider(self.stable, measured(proposals))

    def _restart(self, pod: LocalPod) -> None:
        """Drain the pod, then start it again (it reads its config file anew) and wait until
        it serves and the router sends it requests again."""
        pod.active = False
        deadline = self._clock() + READY_TIMEOUT_S
        while not pod.idle and self._clock() < deadline:
            time.sleep(0.1)  # the supervisor drains it
        pod.active = True
        while not (self._healthy(pod) and self._routed(pod)) and self._clock() < deadline:
            # The supervisor starts it; the router's next check finds it back. Until then the
            # router holds the pod for down (its checks failed while it restarted), and turning
            # the canary off would leave the role with no pod it routes to: a 503.
            time.sleep(0.1)
        logger.info("canary: %s restarted with the promoted config", pod.name)

    def _routed(self, pod: LocalPod) -> bool:
        """Whether every serving router that checks the pod sees it healthy
        (tidegate:router_backend_up); a router that does not know the pod does not count."""
        for router in self.pods:
            if router.role != "router" or router.server is None or not router.active:
                continue
            try:
                response = self._fetch(f"{router.url}/metrics")
            except httpx.HTTPError:
                return False
            if response.status_code != 200:
                return False
            for sample in parse_exposition(response.text):
                seen = sample.name == "tidegate:router_backend_up" and sample.labels.get("url")
                if seen == pod.url and sample.value != 1.0:
                    return False
        return True

    def _turn_off_canaries(self, roles: tuple[str, ...]) -> None:
        for pod in self._canaries(roles):
            pod.active = False

    def _canaries(self, roles: tuple[str, ...]) -> list[LocalPod]:
        return [p for p in self.pods if p.track == "canary" and p.role in roles]

    def _stable_pods(self, role: str) -> list[LocalPod]:
        return [p for p in self.pods if p.track == "stable" and p.role == role and p.active]

    def _healthy(self, pod: LocalPod) -> bool:
        if pod.server is None or pod.exited() is not None:
            return False
        try:
            return self._fetch(f"{pod.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _pages(self, pods: list[LocalPod]) -> dict[str, str]:
        """Each serving pod's /metrics, by name (those that did not answer left out)."""
        pages = {}
        for pod in pods:
            if pod.server is None or pod.draining is not None:
                continue
            try:
                response = self._fetch(f"{pod.url}/metrics")
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                pages[pod.name] = response.text
        return pages

    def _loads(self, pods: list[LocalPod]) -> dict[str, EngineLoad]:
        return {
            name: engine_load(parse_exposition(text)) for name, text in self._pages(pods).items()
        }


def _counts(analysis: Mapping[str, Any]) -> str:
    parts = [
        f"{role}: canary {entry['canaryRequests']} requests ({entry['canaryFailed']} failed), "
        f"stable {entry['stableRequests']} ({entry['stableFailed']} failed);"
        for role, entry in (analysis.get("roles") or {}).items()
    ]
    return " ".join(parts)
