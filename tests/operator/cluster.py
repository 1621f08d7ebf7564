"""An emulated Kubernetes API (kmock) on a background thread, driven over HTTP as kubectl would.

kmock's emulator stores objects and streams watch events, but merges every write as JSON and
does no defaulting, no garbage collection and no Deployment controller: tests play the
controller by writing Deployment status, and assert owner references rather than cascades.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import kmock
import yaml
from kmock._internal import dsl as kmock_dsl
from kmock._internal import k8s as kmock_k8s
from kmock._internal import parsing as kmock_parsing
from kmock._internal import rendering as kmock_rendering
from kopf.testing import KopfRunner

from tests.operator.faults import Faults, gone_event
from tidegate.operator.handlers import OperatorOptions, build_registry
from tidegate.operator.kube import object_path

WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}

INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
# kopf serves only resources whose discovery lists these verbs.
_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
_RESOURCES = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True},
    "apps/v1/replicasets": {"kind": "ReplicaSet", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "autoscaling/v2/horizontalpodautoscalers": {
        "kind": "HorizontalPodAutoscaler",
        "namespaced": True,
    },
    "keda.sh/v1alpha1/scaledobjects": {"kind": "ScaledObject", "namespaced": True},
    INFERENCE_POOLS: {"kind": "InferencePool", "namespaced": True},
    LEADER_WORKER_SETS: {
        "kind": "LeaderWorkerSet",
        "namespaced": True,
        "subresources": {"status", "scale"},
        "shortnames": {"lws"},
    },
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
    # kopf's peering objects, for operators that run with --peering (tidegate operator).
    "kopf.dev/v1/clusterkopfpeerings": {"kind": "ClusterKopfPeering", "namespaced": False},
    "kopf.dev/v1/kopfpeerings": {"kind": "KopfPeering", "namespaced": True},
    "tidegate.dev/v1alpha1/llmdeployments": {
        "kind": "LLMDeployment",
        "namespaced": True,
        "subresources": {"status"},
        "shortnames": {"llmd"},
    },
}


def _parse_namespace_paths(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """kmock 0.8 reads /api/v1/namespaces[/NAME] as a namespace prefix with nothing after it
    (and fails on the list); kopf lists and watches namespaces when told which to serve."""

    def parse_path(path: str) -> Any:
        parts = path.split("?")[0].strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            return parse_path.parsed(  # type: ignore[attr-defined]
                group="", version="v1", plural="namespaces", name=(parts[3:] or [None])[0]
            )
        return parse(path)

    parse_path.parsed = type(parse("/api/v1/pods"))  # type: ignore[attr-defined]
    return parse_path


kmock_parsing.parse_path = _parse_namespace_paths(kmock_parsing.parse_path)


def _sees_request(contains: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    """kmock asks `request in view` of every reaction for every request it serves, and answers
    by walking the whole request log from the oldest: quadratic in a module's thousands of
    polls (a test late in test_operator_e2e.py spent most of its 30-50 s there). The same
    answer for the views the emulator's reactions are made of (the root's log, searched from
    the newest end; a filter's criteria; a priority's source); anything else as kmock does."""

    def sees(view: Any, item: Any) -> bool:
        if not isinstance(item, kmock_rendering.Request):
            return contains(view, item)
        if isinstance(view, kmock_dsl.Root):
            return any(request is item for request in reversed(view._requests))
        if type(view) is kmock_dsl.Filter:
            return bool(view.criteria(item)) and sees(view._source, item)
        if type(view) is kmock_dsl.Priority:
            return sees(view._source, item)
        return contains(view, item)

    return sees


kmock_dsl.View.__contains__ = _sees_request(kmock_dsl.View.__contains__)  # type: ignore[method-assign]


class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, less some resources (a cluster without their CRDs), with faults.

    kmock stores an object of any resource it is sent; kube-apiserver answers 404 to every
    request for a resource it does not serve, and discovery does not list it. The armed
    `faults` (tests/operator/faults.py) act before kmock stores anything.
    """

    def __init__(self, missing: frozenset[str], faults: Faults) -> None:
        super().__init__()
        self.missing = missing
        self.faults = faults

    async def _handle(self, request: Any) -> Any:
        resource = request.resource
        if resource is not None:
            key = "/".join(part for part in (resource.group, resource.version) if part)
            if f"{key}/{resource.plural}" in self.missing:
                raise kmock_k8s.KubernetesResourceNotFoundError()
            if request.action != kmock.action.WATCH:
                await self.faults.before(request)
        return await super()._handle(request)

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        # Asked at each change rather than when the stream opens: kopf's streams stay open.
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and event.get("type") in ("MODIFIED", "DELETED"):
                cut = self.faults.on_watch(request)
                if cut is not None:
                    if cut == "gone":
                        yield gone_event()
                    return
            yield event


class EmulatedCluster:
    """Start with `with EmulatedCluster(tmp_path) as cluster:`; `cluster.kubeconfig` logs in.

    `missing` names resources (as `group/version/plural`) the cluster does not serve.
    """

    def __init__(self, workdir: Path, missing: frozenset[str] = frozenset()) -> None:
        self.missing = missing
        self.faults = Faults()
        self.workdir = workdir
        self.kubeconfig = workdir / "kubeconfig"
        self.emulator: Any = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kmock", daemon=True)
        self._error: BaseException | None = None
        self.http: httpx.Client | None = None

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        self.kubeconfig.write_text(self._kubeconfig("emulated"))
        self.http = httpx.Client(base_url=self.url, timeout=10)
        return self

    def _kubeconfig(self, token: str) -> str:
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "contexts": [
                    {"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}
                ],
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": token}}],
            }
        )

    def kubeconfig_for(self, token: str) -> Path:
        """A kubeconfig that logs in with `token`, which tells one operator's requests from
        another's (`writes(token=...)`, the faults' `token`)."""
        path = self.workdir / f"kubeconfig-{token}"
        path.write_text(self._kubeconfig(token))
        return path

    def __exit__(self, *exc: object) -> None:
        self.faults.clear()
        if self.http is not None:
            self.http.close()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # reported to __enter__
            self._error = error
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with (
            _Emulator(self.missing, self.faults) as emulator,
            kmock.Server(emulator) as server,
        ):
            for key, info in _RESOURCES.items():
                if key not in self.missing:
                    emulator.resources[key] = kmock.ResourceInfo(verbs=_VERBS, **info)
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    # -- kubectl, roughly -----------------------------------------------------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST an object (as `kubectl create`)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace", "default"))
        return self._ok(self.http.post(path, json=obj))  # type: ignore[union-attr]

    def create_namespace(self, name: str) -> None:
        """A Namespace, which kopf waits for when it serves named namespaces."""
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        self._ok(self.http.post("/api/v1/namespaces", json=namespace))  # type: ignore[union-attr]

    def get(self, api_version: str, kind: str, name: str, namespace: str = "default") -> Any:
        """GET an object; None when absent."""
        response = self.http.get(object_path(api_version, kind, namespace, name))  # type: ignore[union-attr]
        return None if response.status_code == 404 else self._ok(response)

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        body: dict[str, Any],
        namespace: str = "default",
        subresource: str = "",
    ) -> dict[str, Any]:
        """Merge-patch an object or its status."""
        path = object_path(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        headers = {"Content-Type": "application/merge-patch+json"}
        return self._ok(self.http.patch(path, json=body, headers=headers))  # type: ignore[union-attr]

    def delete(self, api_version: str, kind: str, name: str, namespace: str = "default") -> None:
        """DELETE an object."""
        self._ok(self.http.delete(object_path(api_version, kind, namespace, name)))  # type: ignore[union-attr]

    @staticmethod
    def _ok(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise AssertionError(
                f"{response.request.method} {response.request.url}: "
                f"{response.status_code} {response.text[:500]}"
            )
        return response.json()

    # -- what the operator did ------------------------------------------------------------

    def writes(
        self, *, since: int = 0, include_events: bool = False, token: str | None = None
    ) -> list[str]:
        """`METHOD path` of every write request from the operator (ours excluded) since `since`;
        with `token`, only those of the operator logged in with it (`kubeconfig_for`)."""
        out = []
        for request in list(self.emulator)[since:]:
            if str(request.method).upper().split(".")[-1] not in WRITE_METHODS:
                continue
            if request.headers.get("User-Agent", "").startswith("python-httpx"):
                continue  # the test's own writes
            if token is not None and request.headers.get("Authorization") != f"Bearer {token}":
                continue
            path = str(request.url.path) if hasattr(request, "url") else str(request.path)
            if "/events" in path and not include_events:
                continue
            out.append(f"{str(request.method).upper().split('.')[-1]} {path}")
        return out

    def requests(self, method: str, path: str, *, since: int = 0) -> list[Any]:
        """The operator's requests (ours excluded) of `method` to exactly `path`, oldest first:
        each has `params` (the query) and `data` (the body)."""
        return [
            request
            for request in list(self.emulator)[since:]
            if str(request.method).upper().split(".")[-1] == method
            and str(request.url.path) == path
            and not request.headers.get("User-Agent", "").startswith("python-httpx")
        ]

    def request_count(self) -> int:
        """How many requests the emulator has served; pass to writes(since=...)."""
        return len(list(self.emulator))


class KopfLog(logging.Handler):
    """Collects kopf's per-object log lines, so a test can wait for a handler to have run."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:
        """Lines so far that contain `text`."""
        return sum(text in line for line in list(self.lines))

    def __enter__(self) -> KopfLog:
        logging.getLogger("kopf.objects").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("kopf.objects").removeHandler(self)


def run_operator(
    cluster: EmulatedCluster, options: OperatorOptions | None = None, timeout: float = 30
) -> KopfRunner:
    """kopf running the operator against `cluster`, all namespaces; enter it to start."""
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    registry = build_registry(options or OperatorOptions())
    return KopfRunner(
        ["run", "--standalone", "--all-namespaces"], registry=registry, timeout=timeout
    )


# Every test module's operator logs here (tests/operator/conftest.py); settle() waits for it
# to go quiet.
KOPF_LOG = KopfLog()


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll until `predicate()` is truthy; its value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, AssertionError):
            last = None
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
