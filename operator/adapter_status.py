"""status.adapters: how many engine pods of an LLMDeployment serve each of its LoRA adapters.

The engines load and unload adapters by themselves, as the ConfigMap's adapters.yaml changes,
and nothing in the API tells when one did. So, as the autoscaler does for load, one asyncio
task per LLMDeployment with spec.adapters asks the pods: every period (`--adapter-period`,
15 s), and at once after a reconcile applied the resource, it lists each engine pool's pods by
their selector labels, scrapes the ready ones' `/metrics` for
`tidegate:lora_adapter_ready{adapter}`, and writes `status.adapters` (`adapter_status` in
`operator/status.py`: one entry per spec adapter) when it differs from what status holds, and
nothing otherwise.

The task (operator/resource_tasks.py) ends when the resource is gone, when its spec is
refused (the next reconcile that applies it starts a task again), or once spec.adapters is
gone and its entry cleared.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tidegate.operator.cluster_scaler import PERIOD_S, Fetch, Scraper
from tidegate.operator.kube import Kube
from tidegate.operator.labels import selector_labels
from tidegate.operator.pool_metrics import parse_exposition, served_adapters
from tidegate.operator.reconcile import ADAPTERS_STATUS_KEY
from tidegate.operator.resource_tasks import ResourceTasks
from tidegate.operator.spec import API_VERSION, KIND, SpecError, parse_spec
from tidegate.operator.status import adapter_status

logger = logging.getLogger("tidegate.adapters")


def _wants_report(resource: Mapping[str, Any]) -> bool:
    """Whether the resource asks for adapters, or its status still lists some to clear."""
    if (resource.get("status") or {}).get(ADAPTERS_STATUS_KEY) is not None:
        return True
    try:
        return parse_spec(resource.get("spec") or {}).adapters is not None
    except SpecError:
        return False


class AdapterReporter(ResourceTasks):
    """Runs one task per LLMDeployment with spec.adapters, which keeps status.adapters current."""

    what = "adapters"

    def __init__(self, kube: Kube, period_s: float = PERIOD_S, fetch: Fetch | None = None) -> None:
        super().__init__(kube, period_s, logger)
        self._scrape = Scraper(fetch)

    def wants(self, resource: Mapping[str, Any]) -> bool:
        return _wants_report(resource)

    async def close(self) -> None:
        """Stop every task and release the scrape connections."""
        await super().close()
        await self._scrape.close()

    async def step(self, resource: Mapping[str, Any]) -> bool:
        """One look at one resource; False when there is nothing left to report."""
        meta = resource["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        try:
            spec = parse_spec(resource.get("spec") or {})
        except SpecError:
            return False  # the pods run the last spec applied; its report stays until fixed
        previous = (resource.get("status") or {}).get(ADAPTERS_STATUS_KEY)
        if spec.adapters is None:
            if previous is not None:
                body = {ADAPTERS_STATUS_KEY: None}
                await self.kube.patch_status(API_VERSION, KIND, namespace, name, body)
            return False
        served = {}
        for role in spec.topology.roles():
            pods = await self.kube.list("v1", "Pod", namespace, selector_labels(name, role))
            texts = await self._scrape.ready_pods(pods)
            served[role] = [served_adapters(parse_exposition(text)) for text in texts.values()]
        entries = adapter_status([adapter.name for adapter in spec.adapters], served)
        if entries != previous:
            body = {ADAPTERS_STATUS_KEY: entries}
            await self.kube.patch_status(API_VERSION, KIND, namespace, name, body)
        return True
