"""status.adapters over an in-memory API: which pods are asked, what is written, and when not."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from tests.operator.test_cluster_scaler import NS, MemoryKube, pod, url
from tidegate.operator.adapter_status import AdapterReporter
from tidegate.operator.labels import selector_labels

SQL = {"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "sql"}}}
CHAT = {"name": "chat", "source": {"pvc": {"claimName": "loras", "path": "chat"}}}


def resource(adapters: list[dict[str, Any]] | None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"hostPath": {"path": "/models/tiny"}}},
        **spec,
    }
    if adapters is not None:
        body["adapters"] = adapters
    return {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": NS, "uid": "uid-llm"},
        "spec": body,
    }


def serving(*adapters: str) -> str:
    return "".join(f'tidegate:lora_adapter_ready{{adapter="{name}"}} 1\n' for name in adapters)


def reporter(
    kube: MemoryKube, answers: dict[str, str | None], period_s: float = 1
) -> AdapterReporter:
    """The report over `kube`, each pod's `/metrics` answering what `answers` holds now."""

    async def fetch(address: str) -> str | None:
        return answers.get(address)

    return AdapterReporter(kube, period_s=period_s, fetch=fetch)  # type: ignore[arg-type]


def in_role(index: int, role: str, **kwargs: Any) -> dict[str, Any]:
    made = pod(index, **kwargs)
    made["metadata"]["labels"] = selector_labels("llm", role)
    return made


def status_writes(kube: MemoryKube) -> list[Any]:
    return [body for kind, _, body in kube.writes if kind == "status"]


def test_each_adapter_counts_the_ready_pods_whose_metrics_say_they_serve_it() -> None:
    kube = MemoryKube()
    kube.objects[("LLMDeployment", "llm")] = resource([SQL, CHAT])
    for index in (1, 2, 3):
        kube.objects[("Pod", f"llm-{index}")] = pod(index, ready=index != 3)
    answers = {url(1): serving("sql", "chat"), url(2): serving("sql"), url(3): serving("sql")}
    step = reporter(kube, answers).step(kube.objects[("LLMDeployment", "llm")])
    assert asyncio.run(step) is True
    # Pod 3 is not ready: not scraped, not counted.
    assert status_writes(kube) == [
        {
            "adapters": [
                {"name": "sql", "readyReplicas": 2},
                {"name": "chat", "readyReplicas": 1},
            ]
        }
    ]


def test_a_report_that_did_not_change_writes_nothing() -> None:
    kube = MemoryKube()
    kube.objects[("LLMDeployment", "llm")] = resource([SQL])
    kube.objects[("Pod", "llm-1")] = pod(1)
    adapters = reporter(kube, {url(1): serving("sql")})
    asyncio.run(adapters.step(copy.deepcopy(kube.objects[("LLMDeployment", "llm")])))
    asyncio.run(adapters.step(copy.deepcopy(kube.objects[("LLMDeployment", "llm")])))
    assert len(status_writes(kube)) == 1
    # A pod that stops answering no longer counts.
    adapters = reporter(kube, {url(1): None})
    asyncio.run(adapters.step(copy.deepcopy(kube.objects[("LLMDeployment", "llm")])))
    assert status_writes(kube)[-1] == {"adapters": [{"name": "sql", "readyReplicas": 0}]}


def test_in_p_d_both_pools_are_asked_and_the_scarcer_one_counts() -> None:
    kube = MemoryKube()
    topology = {"mode": "disaggregated", "prefill": {}, "decode": {"replicas": 2}}
    kube.objects[("LLMDeployment", "llm")] = resource([SQL], topology=topology)
    kube.objects[("Pod", "p-1")] = in_role(1, "prefill")
    kube.objects[("Pod", "d-2")] = in_role(2, "decode")
    kube.objects[("Pod", "d-3")] = in_role(3, "decode")
    kube.objects[("Pod", "r-4")] = in_role(4, "router")  # the router serves no adapter
    answers = {url(1): serving("sql"), url(2): serving("sql"), url(3): serving("sql")}
    answers[url(4)] = serving("sql")
    asyncio.run(reporter(kube, answers).step(kube.objects[("LLMDeployment", "llm")]))
    assert status_writes(kube) == [
        {"adapters": [{"name": "sql", "readyReplicas": 1, "roles": {"prefill": 1, "decode": 2}}]}
    ]


def test_dropping_spec_adapters_clears_the_report_once_and_ends_the_task() -> None:
    kube = MemoryKube()
    kube.objects[("LLMDeployment", "llm")] = resource(None)
    kube.objects[("LLMDeployment", "llm")]["status"] = {
        "adapters": [{"name": "sql", "readyReplicas": 1}]
    }

    async def run() -> None:
        adapters = reporter(kube, {})
        adapters.watch(kube.objects[("LLMDeployment", "llm")])  # a stale entry: one pass
        task = adapters.tasks[(NS, "llm")]
        await asyncio.wait_for(task, 5)
        assert (NS, "llm") not in adapters.tasks
        adapters.watch(kube.objects[("LLMDeployment", "llm")])  # nothing left to clear
        assert adapters.tasks == {}
        await adapters.close()

    asyncio.run(run())
    assert status_writes(kube) == [{"adapters": None}]
    assert "adapters" not in kube.objects[("LLMDeployment", "llm")]["status"]


def test_a_reconcile_has_the_running_task_look_again_at_once() -> None:
    kube = MemoryKube()
    kube.objects[("LLMDeployment", "llm")] = resource([SQL])
    kube.objects[("Pod", "llm-1")] = pod(1)
    answers = {url(1): serving("sql")}

    async def run() -> None:
        adapters = reporter(kube, answers, period_s=3600)
        adapters.watch(kube.objects[("LLMDeployment", "llm")])
        await _until(lambda: len(status_writes(kube)) == 1)
        # An adapter added: the period is an hour, the reconcile's watch() wakes the task.
        kube.objects[("LLMDeployment", "llm")]["spec"]["adapters"].append(CHAT)
        answers[url(1)] = serving("sql", "chat")
        adapters.watch(kube.objects[("LLMDeployment", "llm")])
        await _until(lambda: len(status_writes(kube)) == 2)
        await adapters.close()

    asyncio.run(run())
    assert status_writes(kube)[-1] == {
        "adapters": [{"name": "sql", "readyReplicas": 1}, {"name": "chat", "readyReplicas": 1}]
    }


def test_no_task_without_adapters_and_none_for_a_refused_spec() -> None:
    async def run() -> None:
        adapters = reporter(MemoryKube(), {})
        adapters.watch(resource(None))
        refused = resource([SQL, SQL])
        adapters.watch(refused)
        assert adapters.tasks == {}
        await adapters.close()

    asyncio.run(run())


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)
