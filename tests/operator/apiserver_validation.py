"""What kube-apiserver's own validation refuses in the objects the operator renders, for tests.

The upstream OpenAPI schemas (package kubernetes-validate) check shapes and types; the API
server also checks values in Go (k8s.io/kubernetes/pkg/apis/*/validation): names and label
values are DNS labels of at most 63 characters, a hostPath or subPath has no '..', a
secretKeyRef's key is a config map key, a resource name is native or an extended one,
integer fields are int32. An object that fails any of these is refused on every apply, so a
rendering that trips one would keep the operator retrying forever. Only the checks that
concern fields the operator renders are here, and one bar of our own: no string outside a
ConfigMap's files holds a control character.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_INT32 = 2**31 - 1


def apiserver_refusals(obj: dict[str, Any]) -> list[str]:
    """What kube-apiserver's own validation (beyond the OpenAPI schema) would refuse in `obj`."""
    kind, meta = obj["kind"], obj["metadata"]
    where = f"{kind} {meta['name']!r}"
    out = []
    # LWS's webhook holds a LeaderWorkerSet's name to a Service's: it names the group's
    # headless Services.
    dns_1035 = kind in ("Service", "LeaderWorkerSet")
    name_rule = _DNS_1035 if dns_1035 else _DNS_SUBDOMAIN
    longest = 63 if dns_1035 else 253
    if len(meta["name"]) > longest or not name_rule.fullmatch(meta["name"]):
        out.append(f"{where}: invalid name")
    out += _label_problems(meta.get("labels", {}), where)
    out += [f"{where}: {problem}" for problem in _int_problems(obj)]
    out += [f"{where}: control character in {s!r}" for s in _strings(obj) if _CONTROL.search(s)]
    spec = obj.get("spec", {})
    for selector in _selectors(spec):
        out += _label_problems(selector, where)
    for port in spec.get("ports", []):
        out += _port_name_problems(port.get("name"), where)
    templates = [spec["template"]] if kind == "Deployment" else []
    if kind == "LeaderWorkerSet":
        # The API server sees them in the StatefulSets LWS's controller makes of them.
        group = spec["leaderWorkerTemplate"]
        templates = [group["leaderTemplate"], group["workerTemplate"]]
    for template in templates:
        out += _label_problems(template["metadata"]["labels"], where)
        out += _pod_problems(template["spec"], where)
    return out


def _pod_problems(pod: dict[str, Any], where: str) -> list[str]:
    out = []
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for volume in pod["volumes"]:
        if not _DNS_LABEL.fullmatch(volume["name"]):
            out.append(f"{where}: volume name {volume['name']!r}")
        host_path = volume.get("hostPath", {}).get("path")
        if host_path is not None and ".." in host_path.split("/"):
            out.append(f"{where}: hostPath {host_path!r} has '..'")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        at = f"{where} container {container['name']!r}"
        if len(container["name"]) > 63 or not _DNS_LABEL.fullmatch(container["name"]):
            out.append(f"{at}: invalid name")
        if not container["image"] or re.search(r"\s", container["image"]):
            out.append(f"{at}: image {container['image']!r}")
        for port in container.get("ports", []):
            out += _port_name_problems(port.get("name"), at)
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                out.append(f"{at}: mounts unknown volume {mount['name']!r}")
            sub = mount.get("subPath")
            if sub is not None and (sub.startswith("/") or ".." in sub.split("/")):
                out.append(f"{at}: subPath {sub!r} leaves the volume")
            if "subPathExpr" in mount:
                out.append(f"{at}: subPathExpr expands $(VAR)")
        for env in container.get("env", []):
            if not _ENV_NAME.fullmatch(env["name"]):
                out.append(f"{at}: env name {env['name']!r}")
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and not (_DNS_SUBDOMAIN.fullmatch(ref["name"]) and _config_key(ref["key"])):
                out.append(f"{at}: secretKeyRef {ref}")
        for section in container.get("resources", {}).values():
            for resource, quantity in section.items():
                if resource not in ("cpu", "memory") and not _extended_resource(resource):
                    out.append(f"{at}: resource name {resource!r}")
                if not _QUANTITY.fullmatch(quantity):
                    out.append(f"{at}: quantity {quantity!r}")
    return out


def _label_problems(labels: dict[str, str], where: str) -> list[str]:
    out = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not _qualified(name):
            out.append(f"{where}: label key {key!r}")
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            out.append(f"{where}: label value {value!r}")
    return out


def _port_name_problems(name: str | None, where: str) -> list[str]:
    if name is None:
        return []
    ok = len(name) <= 15 and _PORT_NAME.fullmatch(name) and "--" not in name
    return [] if ok and re.search("[a-z]", name) else [f"{where}: port name {name!r}"]


def _qualified(name: str) -> bool:
    return len(name) <= 63 and bool(_QUALIFIED_NAME.fullmatch(name))


def _extended_resource(name: str) -> bool:
    prefix, _, rest = f"requests.{name}".rpartition("/")
    return (
        "/" in name
        and "kubernetes.io/" not in name
        and len(prefix) <= 253
        and bool(_DNS_SUBDOMAIN.fullmatch(prefix))
        and _qualified(rest)
    )


def _config_key(key: str) -> bool:
    return bool(_CONFIG_KEY.fullmatch(key)) and key != "." and not key.startswith("..")


def _selectors(spec: dict[str, Any]) -> Iterator[dict[str, str]]:
    if isinstance(spec.get("selector"), dict):
        yield spec["selector"].get("matchLabels", spec["selector"])
    if "podSelector" in spec:
        yield spec["podSelector"]["matchLabels"]
    for rule in spec.get("ingress", []):
        for peer in rule.get("from", []):
            yield peer["podSelector"]["matchLabels"]


def _int_problems(value: Any) -> Iterator[str]:
    """Every integer of our objects is an int32 field, and none is negative."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _int_problems(item)
    elif isinstance(value, list):
        for item in value:
            yield from _int_problems(item)
    elif (
        isinstance(value, int | float) and not isinstance(value, bool) and not 0 <= value <= _INT32
    ):
        yield f"{value} is not an int32 of 0 or more"


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "data":  # a ConfigMap's files: checked by parsing them back
                yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value
