"""LoRA adapters end to end: kopf running the operator against kmock's emulator.

An adapter added to the resource reaches the ConfigMap's adapters.yaml that every engine pool
reads, rolls no pod when its folder is on a volume the pods already mount, and shows in
status.adapters as soon as the pods' `/metrics` say they serve it. The emulator has no kubelet:
tests play it by creating Pod objects whose podIP and `http` port point at small `/metrics`
servers on 127.0.0.1 (those of test_autoscaler_e2e.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from tests.operator.cluster import EmulatedCluster, wait_for
from tests.operator.test_autoscaler_e2e import Exposition, add_pod, serve
from tests.operator.test_operator_e2e import (
    config_of,
    edit_spec,
    get,
    llmd,
    settle,
    status,
)
from tidegate.operator.handlers import OperatorOptions

PERIOD_S = 0.2
CONFIG_MAPS = "/api/v1/namespaces/default/configmaps"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
SQL = {"name": "sql", "source": {"pvc": {"claimName": "models", "path": "loras/sql"}}}


@pytest.fixture(scope="module")
def operator_options() -> OperatorOptions:
    return OperatorOptions(adapter_period_s=PERIOD_S)


def spec(**extra: Any) -> dict[str, Any]:
    """A model on a claim, as a user keeps adapters beside it."""
    return {
        "model": {"name": "tiny", "source": {"pvc": {"claimName": "models", "path": "llama"}}},
        "image": "tidegate/engine-cpu:1",
        **extra,
    }


def serving(*adapters: str) -> str:
    return "".join(f'tidegate:lora_adapter_ready{{adapter="{name}"}} 1\n' for name in adapters)


@pytest.fixture
def expositions() -> Iterator[list[Exposition]]:
    made: list[Exposition] = []
    yield made
    for page in made:
        page.close()


def spec_hash(cluster: EmulatedCluster, name: str) -> str:
    deployment = get(cluster, "Deployment", name)
    assert deployment is not None
    return deployment["spec"]["template"]["metadata"]["annotations"]["tidegate.dev/spec-hash"]


def adapters_file(cluster: EmulatedCluster, name: str) -> list[dict[str, str]] | None:
    config_map = get(cluster, "ConfigMap", f"{name}-config")
    text = (config_map or {}).get("data", {}).get("adapters.yaml")
    return None if text is None else yaml.safe_load(text)


def test_an_adapter_added_reaches_the_config_and_the_status_without_a_restart(
    cluster: EmulatedCluster, operator: KopfRunner, expositions: list[Exposition]
) -> None:
    cluster.create(llmd("lora", spec()))
    wait_for(lambda: get(cluster, "Deployment", "lora"), what="the Deployment")
    assert adapters_file(cluster, "lora") is None
    assert "enable-lora" not in config_of(cluster, "lora", "unified")
    without_lora = spec_hash(cluster, "lora")

    # LoRA on, no adapter yet: the engines must start with it, so the pods roll once.
    edit_spec(cluster, "lora", spec(adapters=[]))
    wait_for(lambda: adapters_file(cluster, "lora") == [], what="an empty adapters file")
    settle(cluster)
    assert config_of(cluster, "lora", "unified")["enable-lora"] is True
    assert config_of(cluster, "lora", "unified")["lora-modules-file"] == (
        "/etc/tidegate/adapters.yaml"
    )
    with_lora = spec_hash(cluster, "lora")
    assert with_lora != without_lora
    page = serve(expositions, "")
    add_pod(cluster, "lora-a", "lora", "unified", page)
    wait_for(lambda: status(cluster, "lora").get("adapters") == [], what="an empty report")

    # An adapter beside the model, on its claim: only the ConfigMap is written, and the pod
    # template keeps its hash, so no pod restarts; the engine reads the new file.
    mark = settle(cluster)
    edit_spec(cluster, "lora", spec(adapters=[SQL]))
    wait_for(
        lambda: (
            adapters_file(cluster, "lora")
            == [{"name": "sql", "path": "/adapters/pvc/models/loras/sql"}]
        ),
        what="sql in the adapters file",
    )
    wait_for(
        lambda: status(cluster, "lora").get("adapters") == [{"name": "sql", "readyReplicas": 0}],
        what="sql reported, not served yet",
    )
    settle(cluster)
    writes = [w for w in cluster.writes(since=mark) if "/status" not in w]
    assert writes == [f"PATCH {CONFIG_MAPS}/lora-config"]
    assert spec_hash(cluster, "lora") == with_lora

    # The engine loads it: its /metrics say so, and the status follows.
    page.text = serving("sql")
    wait_for(
        lambda: status(cluster, "lora").get("adapters") == [{"name": "sql", "readyReplicas": 1}],
        what="sql served by the pod",
    )
    add_pod(cluster, "lora-b", "lora", "unified", serve(expositions, serving("sql")))
    wait_for(
        lambda: status(cluster, "lora")["adapters"] == [{"name": "sql", "readyReplicas": 2}],
        what="sql served by both pods",
    )

    # An adapter on a claim the pods do not mount yet: the template must change (a new volume).
    mark = settle(cluster)
    chat = {"name": "chat", "source": {"pvc": {"claimName": "loras", "path": "chat"}}}
    edit_spec(cluster, "lora", spec(adapters=[SQL, chat]))
    wait_for(lambda: spec_hash(cluster, "lora") != with_lora, what="a new pod template")
    settle(cluster)
    writes = [w for w in cluster.writes(since=mark) if "/status" not in w]
    assert sorted(writes) == [f"PATCH {CONFIG_MAPS}/lora-config", f"PATCH {DEPLOYMENTS}/lora"]
    assert [a["name"] for a in adapters_file(cluster, "lora") or []] == ["sql", "chat"]
    wait_for(
        lambda: (
            status(cluster, "lora")["adapters"]
            == [{"name": "sql", "readyReplicas": 2}, {"name": "chat", "readyReplicas": 0}]
        ),
        what="chat reported",
    )

    # No adapters at all: LoRA off, and the report goes.
    edit_spec(cluster, "lora", spec())
    wait_for(lambda: "adapters" not in status(cluster, "lora"), what="the report cleared")
    assert "enable-lora" not in config_of(cluster, "lora", "unified")


def test_prefill_and_decode_get_the_same_adapters_and_both_count(
    cluster: EmulatedCluster, operator: KopfRunner, expositions: list[Exposition]
) -> None:
    topology = {"mode": "disaggregated", "prefill": {}, "decode": {"replicas": 2}}
    cluster.create(llmd("split", spec(topology=topology, adapters=[SQL])))
    wait_for(lambda: get(cluster, "Deployment", "split-decode"), what="the decode pool")
    wait_for(lambda: adapters_file(cluster, "split"), what="the adapters file")
    for role in ("prefill", "decode"):
        config = config_of(cluster, "split", role)
        assert config["enable-lora"] is True
        assert config["lora-modules-file"] == "/etc/tidegate/adapters.yaml"
    assert "enable-lora" not in config_of(cluster, "split", "router")
    add_pod(cluster, "split-p", "split", "prefill", serve(expositions, serving("sql")))
    add_pod(cluster, "split-d1", "split", "decode", serve(expositions, serving("sql")))
    add_pod(cluster, "split-d2", "split", "decode", serve(expositions, serving()))
    wait_for(
        lambda: (
            status(cluster, "split").get("adapters")
            == [{"name": "sql", "readyReplicas": 1, "roles": {"prefill": 1, "decode": 1}}]
        ),
        what="sql counted in both pools",
    )
