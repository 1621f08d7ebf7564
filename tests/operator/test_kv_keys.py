"""The KV transfer's key pair: made once per disaggregated resource, in a Secret the operator
creates and never reads, rewrites or rotates; and made on this machine by `tidegate up`."""

from __future__ import annotations

import asyncio
import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.operator.test_reconcile_replicas import ApplyingKube
from tidegate.engine.config import KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE
from tidegate.engine.kv_transfer.zmq_curve import load_curve_keys
from tidegate.operator.kube import KubeError
from tidegate.operator.kv_keys import key_secret, write_key_dir
from tidegate.operator.labels import MANAGED_BY, MANAGED_BY_LABEL
from tidegate.operator.reconcile import APPLY_FAILED, reconcile
from tidegate.operator.render import RenderOptions, render

LOGGER = logging.getLogger("tests.kv_keys")
SECRET = "Secret/llm-kv-curve"


class SecretsKube(ApplyingKube):
    """ApplyingKube with a Secret's create as the API server answers it: 409 when it exists,
    403 when told to (an operator without the RBAC rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.forbidden = False

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Secret" and self.forbidden:
            raise KubeError(403, 'secrets is forbidden: cannot create resource "secrets"')
        if key in self.objects:
            raise KubeError(409, f"{key} already exists")
        return await super().create(obj)

    def secret_creates(self) -> list[dict[str, Any]]:
        return [w[3] for w in self.writes if w[0] == "create" and w[2] == SECRET]


def resource(**topology: Any) -> dict[str, Any]:
    spec = {
        "model": {"name": "tiny", "source": {"hostPath": {"path": "/models/tiny"}}},
        "topology": {"mode": "disaggregated", "prefill": {}, "decode": {}, **topology},
    }
    meta = {"name": "llm", "namespace": "ml", "uid": "uid-llm", "generation": 1}
    return {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": meta,
        "spec": spec,
    }


def run(kube: SecretsKube, obj: dict[str, Any]) -> Any:
    return asyncio.run(reconcile(kube, obj, RenderOptions(), LOGGER))  # type: ignore[arg-type]


def test_a_fresh_valid_pair_is_made_once_owned_by_the_resource_before_the_pools() -> None:
    kube = SecretsKube()
    outcome = run(kube, resource())
    assert outcome.error is None and SECRET in outcome.created
    created = [w[2] for w in kube.writes if w[0] == "create"]
    assert created.index(SECRET) < created.index("Deployment/llm-prefill")
    (secret,) = kube.secret_creates()
    keys = secret["stringData"]
    assert zmq.curve_public(keys[KV_CURVE_SECRET_KEY_FILE].encode()) == (
        keys[KV_CURVE_PUBLIC_KEY_FILE].encode()
    )
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == "uid-llm" and owner["controller"] is True
    assert secret["metadata"]["labels"][MANAGED_BY_LABEL] == MANAGED_BY
    # Another resource gets a pair of its own.
    other = SecretsKube()
    run(other, resource())
    assert other.secret_creates()[0]["stringData"] != keys

    # An unchanged resource: not even a create that would be refused.
    kube.writes.clear()
    run(kube, resource())
    assert kube.writes == []


def test_an_existing_secret_is_never_rewritten() -> None:
    kube = SecretsKube()
    run(kube, resource())
    before = copy.deepcopy(kube.objects[SECRET])
    changed = resource()
    changed["spec"]["image"] = "tidegate/engine:2"  # the pools roll: the pair is made sure of
    kube.writes.clear()
    outcome = run(kube, changed)
    assert SECRET not in outcome.created and outcome.error is None
    assert kube.objects[SECRET] == before
    assert {w[2] for w in kube.writes if w[0] == "apply"} >= {
        "Deployment/llm-prefill",
        "Deployment/llm-decode",
    }


def test_a_deleted_secret_is_made_again_once_pods_cannot_start() -> None:
    kube = SecretsKube()
    run(kube, resource())
    old = kube.objects.pop(SECRET)  # deleted by hand: new pods cannot mount it
    kube.objects["Deployment/llm-decode"]["status"] = {"unavailableReplicas": 1}
    outcome = run(kube, resource())
    assert SECRET in outcome.created
    assert kube.objects[SECRET]["stringData"] != old["stringData"]


def test_no_pair_without_encryption_and_a_refused_create_degrades() -> None:
    kube = SecretsKube()
    run(kube, resource(kvEncryption="none"))
    assert kube.secret_creates() == [] and SECRET not in kube.objects
    forbidden = SecretsKube()
    forbidden.forbidden = True
    outcome = run(forbidden, resource())
    assert outcome.error is not None and outcome.error[0] == APPLY_FAILED
    assert "secrets" in outcome.error[1]


def test_the_secret_is_described_by_render_and_carries_keys_only_from_the_reconcile() -> None:
    rendered = render(resource())
    assert rendered.kv_keys is not None
    assert set(rendered.kv_keys) == {"apiVersion", "kind", "metadata", "type"}
    filled = key_secret(rendered.kv_keys)
    assert set(filled["stringData"]) == {KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE}
    assert render(resource()).kv_keys == rendered.kv_keys  # no key, so render stays pure


def test_a_local_key_folder_is_private_valid_and_kept(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    write_key_dir(folder)
    keys = load_curve_keys(str(folder))
    assert folder.stat().st_mode & 0o777 == 0o700
    for name in (KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE):
        assert (folder / name).stat().st_mode & 0o777 == 0o600
    write_key_dir(folder)
    assert load_curve_keys(str(folder)) == keys


@pytest.mark.parametrize("topology", [{"kvEncryption": "curve"}, {}])
def test_curve_is_the_default(topology: dict[str, Any]) -> None:
    assert render(resource(**topology)).kv_keys is not None
