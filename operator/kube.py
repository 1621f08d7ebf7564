"""A thin async Kubernetes API client for the objects the operator owns.

kopf watches and patches the LLMDeployment itself; this client creates, applies and deletes
its children and writes the parent's status, with the credentials kopf logged in with.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import kopf

from tidegate.operator.spec import API_VERSION, KIND, PLURAL

FIELD_MANAGER = "tidegate-operator"
# The operator's autoscaler sets an autoscaled pool's spec.replicas under its own field
# manager: the reconcile's applies leave that field out, and neither undoes the other.
AUTOSCALER_FIELD_MANAGER = "tidegate-autoscaler"
# How long a replaced connection stays open for the calls already using it.
_OLD_SESSION_GRACE_S = 60.0

# (apiVersion, kind) -> plural of every kind the operator owns: it renders, applies, watches
# and deletes objects of these kinds.
OWNED_KINDS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
}
# Owned kinds of APIs that a cluster may lack (another project's CRD), with what installs them.
# Listing or deleting them there finds none; creating one is answered 404, which the reconcile
# reports without failing the rest of the resource.
OPTIONAL_KINDS: dict[tuple[str, str], str] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "the Gateway API Inference Extension",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): (
        "LeaderWorkerSet (kubernetes-sigs/lws), which runs a replica over several nodes"
    ),
}
# ... and of every kind it reads or writes: those, the LLMDeployment itself, for the
# autoscaler the pools' pods (read, and annotated with a deletion cost) and Events, and the
# Deployments' ReplicaSets (read: each revision's pods).
KINDS: dict[tuple[str, str], str] = {
    **OWNED_KINDS,
    (API_VERSION, KIND): PLURAL,
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    # The Deployments' ReplicaSets, read for status.revisions.
    ("apps/v1", "ReplicaSet"): "replicasets",
    # The KV transfer's key pair (operator/kv_keys.py): created, never read, listed or watched.
    ("v1", "Secret"): "secrets",
}


class KubeError(Exception):
    """A refused API call; `status` is the HTTP status and the message the API server's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """The REST path of a namespaced object, or of its collection when name is None."""
    plural = KINDS[(api_version, kind)]
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    """Create, apply, list, delete and patch status over one connection."""

    def __init__(self, info: kopf.ConnectionInfo, timeout_s: float = 30.0) -> None:
        self._info = info
        # A call still unanswered after this is a KubeError 503, like an unreachable server.
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                headers=self._info.as_http_headers(),
                connector=aiohttp.TCPConnector(ssl=self._info.as_ssl_context()),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            )
        return self._session

    def update(self, info: kopf.ConnectionInfo) -> None:
        """New credentials: later calls use them; calls in flight finish on the old connection."""
        self._info = info
        old, self._session = self._session, None
        if old is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(_OLD_SESSION_GRACE_S, lambda: loop.create_task(old.close()))

    async def close(self) -> None:
        """Release the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with self._client().request(
                method, path.lstrip("/"), data=data, headers=headers, params=params
            ) as response:
                status, text = response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as error:
            # Unreachable or cut off: the same to the caller as a 503, a reason to retry.
            raise KubeError(503, f"{method} {path}: {error!r}") from error
        if status == 404 and method == "GET":
            return None
        if status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except ValueError:
                message = text
            raise KubeError(status, message)
        return json.loads(text) if text else {}

    async def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return await self._call("GET", object_path(api_version, kind, namespace, name))

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace that carry all the given labels."""
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        result = await self._call(
            "GET", object_path(api_version, kind, namespace), params={"labelSelector": selector}
        )
        items = (result or {}).get("items", [])
        # Filter here too: a server that ignores the selector must not widen what we touch.
        return [
            item
            for item in items
            if labels.items() <= (item.get("metadata", {}).get("labels") or {}).items()
        ]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object; KubeError 409 when it exists."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return await self._call("POST", path, obj, params={"fieldManager": FIELD_MANAGER}) or {}

    async def apply(
        self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER
    ) -> dict[str, Any]:
        """Server-side apply: we own exactly the fields we send, other managers keep theirs."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": field_manager, "force": "true"}
        return (
            await self._call("PATCH", path, obj, "application/apply-patch+yaml", params=params)
            or {}
        )

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """A JSON merge patch of an object (say, one annotation of a pod we do not own)."""
        path = object_path(api_version, kind, namespace, name)
        return await self._call("PATCH", path, patch, "application/merge-patch+json") or {}

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete an object; one that is already gone is fine."""
        try:
            await self._call("DELETE", object_path(api_version, kind, namespace, name))
        except KubeError as error:
            if error.status != 404:
                raise

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge `status` into the object's status subresource."""
        path = object_path(api_version, kind, namespace, name) + "/status"
        return (
            await self._call("PATCH", path, {"status": status}, "application/merge-patch+json")
            or {}
        )
