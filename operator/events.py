"""Events on an LLMDeployment, as `kubectl describe` shows them (core/v1 Event)."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

from tidegate.operator.kube import Kube, KubeError
from tidegate.operator.spec import API_VERSION, KIND


def rfc3339(at: float) -> str:
    """A time as Kubernetes writes it, to the second."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def resource_event(
    resource: Mapping[str, Any],
    *,
    type: str,
    reason: str,
    message: str,
    component: str,
    now: float,
) -> dict[str, Any]:
    """A core/v1 Event about `resource` (type Normal or Warning)."""
    meta = resource["metadata"]
    namespace = meta.get("namespace") or "default"
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        # As the Kubernetes event recorder names them: the object, then a unique suffix.
        "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": namespace,
            "uid": meta.get("uid"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": type,
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post_event(kube: Kube, event: dict[str, Any], logger: logging.Logger) -> None:
    """Create the Event; one the API server refuses is logged (what it tells is in status)."""
    try:
        await kube.create(event)
    except KubeError as error:
        name = event["involvedObject"]["name"]
        logger.warning(f"no {event['reason']} Event for {name}: {error}")
