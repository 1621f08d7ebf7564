"""What a change rolls: each role's pods that restart, and the flags or pod parts why."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tests.operator.test_operator_cli import EXAMPLES, tidegate
from tests.operator.test_operator_e2e import GPU_SPEC
from tests.operator.test_render import disaggregated, model, render_spec
from tidegate.operator.labels import CANARY_TRACK, TRACK_LABEL
from tidegate.operator.rollout import (
    CANARY_REVISION,
    CANARY_SUFFIX,
    FlagChange,
    Staged,
    role_changes,
    rollout_steps,
    stage,
)

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


# -- canaries ---------------------------------------------------------------------------------

CANARY = {
    "model": model(),
    "topology": {"mode": "unified", "unified": {"replicas": 3}},
    "rollout": {"strategy": "canary", "canary": {"trafficPercent": 20}},
}
SLOWER = copy.deepcopy(CANARY) | {"scheduling": {"maxNumSeqs": 64}}


def staged(before: dict[str, Any], after: dict[str, Any], rolled_back: str | None = None) -> Staged:
    return stage(
        render_spec(after), render_spec(before), rolled_back=rolled_back, traffic_percent=20
    )


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_a_canary_runs_the_new_template_beside_the_untouched_stable_pods() -> None:
    old, new = render_spec(CANARY), render_spec(SLOWER)
    result = stage(new, old, rolled_back=None, traffic_percent=20)
    assert result.mode == "canary" and result.roles == ("unified",)
    stable = named(result.objects, "Deployment", "llm")
    assert stable == named(old.objects, "Deployment", "llm")  # not one field moves
    canary = named(result.objects, "Deployment", f"llm{CANARY_SUFFIX}")
    fresh = named(new.objects, "Deployment", "llm")
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["selector"]["matchLabels"][TRACK_LABEL] == CANARY_TRACK
    template = canary["spec"]["template"]
    assert template["metadata"]["labels"][TRACK_LABEL] == CANARY_TRACK
    assert template["metadata"]["annotations"][CANARY_REVISION] == result.revision
    assert template["spec"]["containers"][0]["args"][-1].endswith("/unified-canary.yaml")
    assert template["spec"]["volumes"] == fresh["spec"]["template"]["spec"]["volumes"]
    data = named(result.objects, "ConfigMap", "llm-config")["data"]
    assert (
        data["unified.yaml"]
        == named(old.objects, "ConfigMap", "llm-config")["data"]["unified.yaml"]
    )
    canary_config = yaml.safe_load(data["unified-canary.yaml"])
    assert canary_config["max-num-seqs"] == 64
    assert canary_config["track"] == "canary" and canary_config["traffic-weight"] == 0.2


def test_the_stable_pods_follow_new_replicas_at_once() -> None:
    after = copy.deepcopy(SLOWER)
    after["topology"]["unified"]["replicas"] = 5
    result = staged(CANARY, after)
    assert result.mode == "canary"
    assert named(result.objects, "Deployment", "llm")["spec"]["replicas"] == 5


def test_what_no_canary_can_try_applies_directly() -> None:
    assert staged(CANARY, copy.deepcopy(CANARY)).mode == "direct"  # nothing rolls
    replicas = copy.deepcopy(CANARY)
    replicas["topology"]["unified"]["replicas"] = 1
    assert staged(CANARY, replicas).mode == "direct"
    rolling = {**SLOWER, "rollout": {"strategy": "rolling"}}
    assert staged(CANARY, rolling).mode == "direct"
    split = {**CANARY, "topology": disaggregated()}
    assert staged(CANARY, split).mode == "direct"  # the roles change
    first = stage(render_spec(SLOWER), None, rolled_back=None, traffic_percent=20)
    assert first.mode == "direct"


def test_a_rolled_back_change_is_held_until_it_changes() -> None:
    revision = staged(CANARY, SLOWER).revision
    held = staged(CANARY, SLOWER, rolled_back=revision)
    assert held.mode == "held" and held.revision == revision
    assert not [o for o in held.objects if o["metadata"]["name"].endswith(CANARY_SUFFIX)]
    assert "unified-canary.yaml" not in named(held.objects, "ConfigMap", "llm-config")["data"]
    # An edit elsewhere keeps the same change of the pods, and the same revision.
    elsewhere = SLOWER | {"service": {"port": 8080}}
    assert staged(CANARY, elsewhere, rolled_back=revision).mode == "held"
    other = copy.deepcopy(CANARY) | {"scheduling": {"maxNumSeqs": 32}}
    assert staged(CANARY, other, rolled_back=revision).mode == "canary"


def test_the_canary_strategy_puts_the_router_in_front() -> None:
    rendered = render_spec(CANARY)
    assert named(rendered.objects, "Deployment", "llm-router")
    service = named(rendered.objects, "Service", "llm")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"


def test_plan_lists_the_canary_steps(tmp_path: Path) -> None:
    old = yaml.safe_load((EXAMPLES / "canary-tiny.yaml").read_text())
    new = copy.deepcopy(old)
    new["spec"]["scheduling"] = {"maxNumSeqs": 8}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(new))
    done = tidegate("plan", "-f", str(tmp_path / "new.yaml"), "--from", str(tmp_path / "old.yaml"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "1. canary: tiny-canary-canary" in out and "get 50% of the role's requests" in out
    assert "2. compare with the stable pods at 20, 40 and 80 canary requests" in out
    assert "3b. rolled back" in out
    assert "kubectl annotate llmd tiny-canary tidegate.dev/canary=promote" in out


def test_steps_of_a_rolling_change_say_why_there_is_no_canary() -> None:
    steps = rollout_steps("t", render_spec(UNIFIED), render_spec(UNIFIED | {"image": "x:2"}))
    assert steps == ["every changed role rolls at once, surge-first (rollout.strategy is rolling)"]
    assert rollout_steps("t", render_spec(UNIFIED), render_spec(UNIFIED)) == ["no pod restarts"]
