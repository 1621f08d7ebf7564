"""One asyncio task per LLMDeployment that needs one, started by the reconcile.

The autoscaler (operator/cluster_scaler.py), the adapter report (operator/adapter_status.py)
and the rollout controller (operator/rollout_controller.py) look at a resource's pods every
period; the last two also at once when started and after each reconcile (`look_now`). They are not kopf daemons or timers: kopf guards those with a
finalizer, which writes to every resource and blocks its deletion while the operator is gone.
Each task ends when the resource is gone or `step` says there is nothing left to do; the
next reconcile that needs it starts it again. A refused API call or a failed scrape is logged
and tried again the next period: nothing here stops the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from tidegate.operator.kube import Kube, KubeError
from tidegate.operator.spec import API_VERSION, KIND


class ResourceTasks:
    """Runs `step` for each watched resource every `period_s`, until it returns False."""

    # What the tasks do, for their names and log lines.
    what = "task"
    # Look when the task starts and whenever `watch` is called for it again; False: only
    # every period (the autoscaler's decisions keep to its pace).
    look_now = True

    def __init__(self, kube: Kube, period_s: float, logger: logging.Logger) -> None:
        self.kube = kube
        self.period_s = period_s
        self.logger = logger
        self.tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._wake: dict[tuple[str, str], asyncio.Event] = {}

    def wants(self, resource: Mapping[str, Any]) -> bool:
        """Whether the resource needs a task now."""
        raise NotImplementedError

    async def step(self, resource: Mapping[str, Any]) -> bool:
        """One look at one resource; False when there is nothing left to do."""
        raise NotImplementedError

    def ended(self, namespace: str, name: str) -> None:
        """The resource's task ends (nothing left to do, the resource gone, or cancelled)."""

    def watch(self, resource: Mapping[str, Any]) -> None:
        """After a reconcile applied `resource`: start its task if it needs one and none runs,
        else have the running one look now (what it watches may have just changed)."""
        meta = resource["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        task = self.tasks.get(key)
        if task is not None and not task.done():
            if self.look_now:
                self._wake[key].set()
            return
        if not self.wants(resource):
            return
        self._wake[key] = asyncio.Event()
        self.tasks[key] = asyncio.get_running_loop().create_task(
            self._run(*key), name=f"{self.what} {key[0]}/{key[1]}"
        )

    def forget(self, namespace: str, name: str) -> None:
        """Stop the resource's task (it was deleted)."""
        task = self.tasks.pop((namespace, name), None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Stop every task."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        wake = self._wake[key]
        first = True
        try:
            while True:
                if not (first and self.look_now):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), self.period_s)
                first = False
                wake.clear()
                try:
                    resource = await self.kube.get(API_VERSION, KIND, namespace, name)
                    if resource is None or resource["metadata"].get("deletionTimestamp"):
                        return
                    if not await self.step(resource):
                        return
                except KubeError as error:
                    self.logger.warning(f"{self.what} of {namespace}/{name}: {error}; next period")
                except Exception:
                    self.logger.exception(f"{self.what} of {namespace}/{name} failed; next period")
        finally:
            self.ended(namespace, name)
            if self.tasks.get(key) is asyncio.current_task():
                self.tasks.pop(key)
                self._wake.pop(key, None)
