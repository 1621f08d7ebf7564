"""What a change rolls: each role's pods that restart, and the flags or pod parts why."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tests.operator.test_operator_cli import EXAMPLES, tidegate
from tests.operator.test_operator_e2e import GPU_SPEC
from tests.operator.test_render import disaggregated, model, render_spec
from tidegate.operator.rollout import FlagChange, role_changes

UNIFIED = {"model": model(), "topology": {"mode": "unified", "unified": {"replicas": 2}}}
SPLIT = {"model": model(), "topology": disaggregated()}


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {c.role: c for c in role_changes(render_spec(before), render_spec(after))}


def test_the_same_spec_restarts_nothing() -> None:
    found = changes(SPLIT, copy.deepcopy(SPLIT))
    assert {role: c.kind for role, c in found.items()} == {
        "prefill": "unchanged",
        "decode": "unchanged",
        "router": "unchanged",
    }
    assert found["decode"].describe() == "nothing restarts"


def test_replicas_alone_scale_without_a_restart() -> None:
    after = copy.deepcopy(UNIFIED)
    after["topology"]["unified"]["replicas"] = 4
    (change,) = changes(UNIFIED, after).values()
    assert change.kind == "scales" and change.replicas == (2, 4)
    assert change.describe() == "replicas 2 -> 4; no pod restarts"


def test_a_tighter_itl_slo_rolls_the_pods_and_names_the_flag() -> None:
    before = copy.deepcopy(GPU_SPEC)
    after = copy.deepcopy(GPU_SPEC)
    after["scheduling"] = {"slo": {"ttftMs": 800, "itlMs": 25}}
    (change,) = changes(before, after).values()
    assert change.kind == "rolls" and not change.pod_parts
    (flag,) = [f for f in change.flags if f.flag == "long-prefill-token-threshold"]
    assert flag.after < flag.before
    assert "rolls surge-first" in change.describe()
    assert f"long-prefill-token-threshold {flag.before} -> {flag.after}" in change.describe()


def test_a_new_image_rolls_every_engine_role_and_the_router() -> None:
    after = copy.deepcopy(SPLIT) | {"image": "registry.example/engine:2"}
    found = changes(SPLIT, after)
    for role in ("prefill", "decode", "router"):
        assert found[role].kind == "rolls" and found[role].pod_parts == ["image"], role
        assert found[role].flags == []


def test_turning_the_gateway_on_rolls_decode_and_router_only() -> None:
    found = changes(SPLIT, copy.deepcopy(SPLIT) | {"gateway": {"inferencePool": True}})
    assert found["prefill"].kind == "unchanged"
    decode = {f.flag for f in found["decode"].flags}
    assert decode == {"prefill-via-header", "prefill-hosts"}
    assert FlagChange("epp-port", None, 9002) in found["router"].flags
    assert "ports" in found["router"].pod_parts  # the picker's container port


def test_switching_topology_removes_one_pool_and_adds_the_others() -> None:
    found = changes(UNIFIED, SPLIT)
    assert found["unified"].kind == "removed"
    assert found["unified"].describe() == "removed: its 2 pod(s) stop"
    assert {found[r].kind for r in ("prefill", "decode", "router")} == {"added"}


def test_plan_from_the_running_manifest_shows_what_restarts(tmp_path: Path) -> None:
    old = yaml.safe_load((EXAMPLES / "disaggregated-tiny.yaml").read_text())
    new = copy.deepcopy(old)
    new["spec"]["image"] = "registry.example/engine:2"
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(new))
    done = tidegate("plan", "-f", str(tmp_path / "new.yaml"), "--from", str(tmp_path / "old.yaml"))
    assert done.returncode == 0, done.stderr
    assert "WHAT THE CHANGE DOES" in done.stdout
    rows = [line for line in done.stdout.splitlines() if "rolls surge-first" in line]
    assert len(rows) == 3 and all("(image)" in row for row in rows)
    # Without --from, no such section.
    assert "WHAT THE CHANGE DOES" not in tidegate("plan", "-f", str(tmp_path / "new.yaml")).stdout
