"""The kopf handlers: thin, every one ends in `reconcile` for the resource concerned.

- create / update / resume of an LLMDeployment: reconcile it;
- every change of an object we own (a rollout moving, someone editing or deleting a
  child): reconcile its owner, which refreshes status and undoes edits to our fields;
- delete: children carry owner references, so the garbage collector removes them; we
  also delete them ourselves, for clusters or tools that strip owner references.

kopf keeps its own bookkeeping under status.kopf (not in annotations): a GitOps tool that
compares metadata and spec sees no drift. There is no timer: kopf guards timers with a
finalizer, which would write to every resource and block deletion when the operator is gone.
For the same reason the autoscaler is not a kopf daemon: each reconcile of a resource whose
policies the operator drives starts its task in `ClusterAutoscaler` if none runs, and the task
ends by itself once the resource is gone or has no such policy (`operator/cluster_scaler.py`).
The report of a resource's LoRA adapters (status.adapters, `operator/adapter_status.py`) runs
the same way, and so does the rollout controller, which judges a running canary
(`operator/rollout_controller.py`); a change of the resource's annotations (the canary's
promote or abort by hand) wakes it.

A refused, cut off or slow API call fails the pass, which is tried again after a delay that
doubles: by kopf for create, update and resume, by `run_or_retry` after a child's event or a
canary verdict (kopf does not retry event handlers). With `OperatorOptions.peering`, several
operators share kopf's peering object and only the one started first reconciles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tidegate.operator.adapter_status import AdapterReporter
from tidegate.operator.cluster_scaler import PERIOD_S, ClusterAutoscaler
from tidegate.operator.kube import OWNED_KINDS, Kube, KubeError
from tidegate.operator.labels import MANAGED_BY, MANAGED_BY_LABEL, owned_labels
from tidegate.operator.reconcile import APPLY_FAILED, CRD_NOT_INSTALLED, reconcile
from tidegate.operator.render import RenderOptions
from tidegate.operator.rollout_controller import RolloutController
from tidegate.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION


@dataclass(frozen=True)
class OperatorOptions:
    """What `tidegate operator` is started with."""

    render: RenderOptions = field(default_factory=RenderOptions)
    # Retry delay after the API server refused a write (conflict, outage, throttling, or an
    # object it will never take); it doubles with each retry up to the maximum, so that a
    # refusal that lasts costs a write every few minutes, not every few seconds.
    retry_seconds: float = 10.0
    max_retry_seconds: float = 600.0
    # How long one API call may take; one that takes longer counts as refused and is retried.
    api_timeout_s: float = 30.0
    # kopf peering (`--peering NAME`): operators that share the peering object NAME (a
    # ClusterKopfPeering, or a KopfPeering in each served namespace) elect one to reconcile,
    # the longest running; the others stand by. None: standalone, the only operator.
    peering: str | None = None
    # Seconds an operator's keep-alive in the peering object holds: how long its successor
    # waits after a crash (a clean exit withdraws it, and the successor takes over at once).
    peering_lifetime_s: int = 60
    # The autoscaler's period, and the port of the operator's /metrics (None: not served).
    autoscale_period_s: float = PERIOD_S
    metrics_port: int | None = None
    # How often status.adapters is refreshed from the engine pods' /metrics.
    adapter_period_s: float = PERIOD_S
    # How often a running canary's pods are scraped and compared with the stable ones.
    rollout_period_s: float = PERIOD_S

    def retry_delay(self, retry: int) -> float:
        """Seconds to wait after the `retry`-th retry (0: the first attempt) failed."""
        return min(self.retry_seconds * 2 ** min(retry, 32), self.max_retry_seconds)


class _State:
    """The connection and the per-resource locks, shared by all handlers of one operator."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.autoscaler: ClusterAutoscaler | None = None
        self.adapters: AdapterReporter | None = None
        self.rollouts: RolloutController | None = None
        # The autoscaler's gauges: served from startup on, filled once it runs.
        self.registry = CollectorRegistry()
        self.metrics: web.AppRunner | None = None
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.pending: set[tuple[str, str]] = set()
        # Retries of passes that no kopf handler retries (after a child's event or a canary
        # verdict), one at most per resource.
        self.retries: dict[tuple[str, str], asyncio.Task[None]] = {}

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


def configure(settings: kopf.OperatorSettings, options: OperatorOptions) -> None:
    """kopf settings: bookkeeping in status, events only for warnings and errors, and the
    priority and lifetime the operator peers with (under `--peering`)."""
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.diffbase")
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # kopf lets the peer of highest priority work and pauses the others (all of them on a
    # tie). The earlier start wins, so a replica that starts later (a restart, a rollout)
    # never takes over from a working one, and the next oldest takes over when it goes.
    settings.peering.priority = -time.time_ns() // 1000
    settings.peering.lifetime = options.peering_lifetime_s


def build_registry(options: OperatorOptions | None = None) -> kopf.OperatorRegistry:
    """A registry holding every handler of the operator, configured by `options`."""
    options = options or OperatorOptions()
    registry = kopf.OperatorRegistry()
    state = _State()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, options)
        if options.metrics_port is not None:
            # Here rather than at login: a port already taken stops the operator at once.
            state.metrics = await serve_metrics(state.registry, options.metrics_port)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: the service account; elsewhere: KUBECONFIG or ~/.kube/config. kopf calls
        # this again when the credentials expire; our client follows.
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            if state.kube is None:
                state.kube = Kube(info, timeout_s=options.api_timeout_s)
                state.autoscaler = ClusterAutoscaler(
                    state.kube, options.autoscale_period_s, registry=state.registry
                )
                state.adapters = AdapterReporter(state.kube, options.adapter_period_s)
                state.rollouts = RolloutController(
                    state.kube, options.rollout_period_s, reconcile=reconcile_after_verdict
                )
            else:
                state.kube.update(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in state.retries.values():
            task.cancel()
        if state.metrics is not None:
            await state.metrics.cleanup()
        if state.autoscaler is not None:
            await state.autoscaler.close()
        if state.adapters is not None:
            await state.adapters.close()
        if state.rollouts is not None:
            await state.rollouts.close()
        if state.kube is not None:
            await state.kube.close()

    async def run(body: kopf.Body, logger: Any, retry: int = 0) -> None:
        meta = body["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        lock = state.lock(*key)
        if lock.locked():
            # A pass is running: it will run once more and see whatever changed meanwhile.
            # A burst of child events (a rollout) costs two passes, not one per event.
            state.pending.add(key)
            return
        async with lock:
            while True:
                state.pending.discard(key)
                await reconcile_once(*key, logger, retry)
                if key not in state.pending:
                    break
        # Done: a retry still waiting for this resource has nothing left to do.
        waiting = state.retries.pop(key, None)
        if waiting is not None:
            waiting.cancel()

    async def run_or_retry(namespace: str, name: str, logger: Any, why: str) -> None:
        """A pass that no kopf handler retries: a refused one is tried again after the same
        doubling delay, in a task of its own, until one succeeds."""

        async def attempt(retry: int) -> None:
            parent = {"metadata": {"name": name, "namespace": namespace}}
            try:
                await run(parent, logger, retry)
            except kopf.TemporaryError as error:
                if key in state.retries:
                    return  # a retry waits already
                delay = options.retry_delay(retry)
                logger.warning(f"{name} not reconciled {why}: {error}; again in {delay:g} s")
                state.retries[key] = asyncio.create_task(later(retry + 1, delay))

        async def later(retry: int, delay: float) -> None:
            await asyncio.sleep(delay)
            state.retries.pop(key, None)
            await attempt(retry)

        key = (namespace, name)
        await attempt(0)

    async def reconcile_after_verdict(namespace: str, name: str) -> None:
        # The rollout controller promoted or rolled back a canary: apply what that means now.
        await run_or_retry(
            namespace, name, logging.getLogger("tidegate.rollout"), "after a canary verdict"
        )

    async def reconcile_once(namespace: str, name: str, logger: Any, retry: int) -> None:
        try:
            refused = await reconcile_latest(namespace, name, logger)
        except KubeError as error:  # a read or the status write refused, cut off or too slow
            refused = str(error)
        if refused is not None:
            raise kopf.TemporaryError(refused, delay=options.retry_delay(retry))

    async def reconcile_latest(namespace: str, name: str, logger: Any) -> str | None:
        """One pass over the resource as it is now; why to try again, or None."""
        assert state.kube is not None, "login handler did not run"
        # Read afresh: the body of a queued event may be stale.
        latest = await state.kube.get(API_VERSION, KIND, namespace, name)
        if latest is None or latest.get("metadata", {}).get("deletionTimestamp"):
            return None
        outcome = await reconcile(state.kube, latest, options.render, logger)
        reason = outcome.error[0] if outcome.error is not None else None
        # A missing CRD left one object out: the pools run, so their autoscaler and report do.
        if reason in (None, CRD_NOT_INSTALLED) and state.autoscaler is not None:
            state.autoscaler.watch(latest)
        if reason in (None, CRD_NOT_INSTALLED) and state.adapters is not None:
            state.adapters.watch(latest)
        canary = ((latest.get("spec") or {}).get("rollout") or {}).get("strategy") == "canary"
        if reason in (None, CRD_NOT_INSTALLED) and canary and state.rollouts is not None:
            # Read again: the reconcile has just written status.rollout.
            refreshed = await state.kube.get(API_VERSION, KIND, namespace, name)
            if refreshed is not None:
                state.rollouts.watch(refreshed)
        # A spec the operator refuses is in status and not retried: nothing would change until
        # the spec does, and a new spec is a new reconcile. A CRD installed later brings no
        # event of ours, so that pass is retried like a refused apply.
        if outcome.error is not None and reason in (APPLY_FAILED, CRD_NOT_INSTALLED):
            return outcome.error[1]
        return None

    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    @kopf.on.resume(*resource, registry=registry)
    async def reconcile_resource(body: kopf.Body, logger: Any, retry: int = 0, **_: Any) -> None:
        await run(body, logger, retry)

    @kopf.on.update(*resource, field="metadata.annotations", registry=registry)
    async def annotations_changed(body: kopf.Body, **_: Any) -> None:
        # tidegate.dev/canary: promote | abort, which the rollout controller acts on.
        if state.rollouts is not None:
            state.rollouts.watch(body)

    async def child_changed(body: kopf.Body, type: str | None, logger: Any, **_: Any) -> None:
        owner = _owner_name(body)
        if owner is None or type is None:  # type None: the initial listing, resume covers it
            return
        namespace = body["metadata"].get("namespace") or "default"
        await run_or_retry(namespace, owner, logger, "after a change of its child")

    for api_version, kind in OWNED_KINDS:
        group, _, version = api_version.rpartition("/")
        kopf.on.event(
            group,
            version,
            kind,
            labels={MANAGED_BY_LABEL: MANAGED_BY},
            registry=registry,
            id=f"child-{kind.lower()}",
        )(child_changed)

    @kopf.on.delete(*resource, optional=True, registry=registry)
    async def delete_children(body: kopf.Body, logger: Any, **_: Any) -> None:
        meta = body["metadata"]
        namespace = meta.get("namespace", "default")
        if state.autoscaler is not None:
            state.autoscaler.forget(namespace, meta["name"])
        if state.adapters is not None:
            state.adapters.forget(namespace, meta["name"])
        if state.rollouts is not None:
            state.rollouts.forget(namespace, meta["name"])
        if state.kube is None:
            return
        for api_version, kind in OWNED_KINDS:
            for item in await state.kube.list(
                api_version, kind, namespace, owned_labels(meta["name"])
            ):
                await state.kube.delete(api_version, kind, namespace, item["metadata"]["name"])
        logger.info(f"deleted the children of {meta['name']}")

    return registry


async def serve_metrics(registry: CollectorRegistry, port: int) -> web.AppRunner:
    """Serve `registry` at http://0.0.0.0:`port`/metrics until cleaned up."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


def _owner_name(body: kopf.Body) -> str | None:
    for ref in body["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller"):
            return ref.get("name")
    return None


def run_operator(
    options: OperatorOptions,
    *,
    namespaces: list[str],
    liveness_endpoint: str | None,
) -> None:
    """Run until stopped: every namespace when `namespaces` is empty, else only those."""
    kopf.run(
        registry=build_registry(options),
        standalone=options.peering is None,
        peering_name=options.peering,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness_endpoint,
    )
