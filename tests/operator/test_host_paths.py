"""The operator's hostPath allow-lists: hostile node paths refused, allowed ones rendered as given.

The policy alone refuses each hostile path, whatever the spec model would have said first;
through `render`, each is refused by one layer or the other, and the Degraded condition the
operator writes names the field and the flag to set.
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
from typing import Any

import pytest

from tests.operator.test_hostile_specs import degraded_condition
from tidegate.cli import build_parser
from tidegate.operator.cli import operator_options
from tidegate.operator.host_paths import (
    CACHE_FLAG,
    READ_ONLY_FLAG,
    REASON,
    HostPathPolicy,
    HostPathRefused,
)
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.plan import plan
from tidegate.operator.render import RenderOptions, render
from tidegate.operator.spec import API_VERSION, KIND, SpecError

REPO = Path(__file__).resolve().parents[2]
MODELS, CACHE = "/models", "/var/cache/tidegate"
POLICY = HostPathPolicy(read_only=(MODELS, "/srv/loras"), cache=(CACHE,))

# Read-only sources (model, adapters) that POLICY must refuse.
HOSTILE_SOURCES = [
    "/",
    "//",
    "/etc",
    "/etc/shadow",
    "/models/../etc",
    "/models/..",
    "/models/a/../../etc",
    "/models/./../../root",
    "//etc",
    "///models/../etc",
    "/models-x",
    "/models-evil/llama",
    "/model",
    "/Models/llama",
    "/models%2f../etc",
    "/var/run/secrets/kubernetes.io/serviceaccount",
    "/var/lib/kubelet/pods",
    "/proc/1/root",
    "/root/.ssh",
    "/var/cache/tidegate/models/x",  # the writable cache is no read-only source
]
ALLOWED_SOURCES = {
    "/models": "/models",
    "/models/": "/models",
    "/models/llama": "/models/llama",
    "/models//llama/./8b/": "/models/llama/8b",
    "//models/llama": "/models/llama",
    "/models/llama..v2": "/models/llama..v2",  # a name with dots, not a '..' component
    "/srv/loras/chat": "/srv/loras/chat",
}
HOSTILE_CACHES = [
    "/",
    "/etc",
    "/var/cache",
    "/var/cache/tidegate/sub",  # below the folder: pods of another resource write there
    "/var/cache/tidegate-x",
    "/var/cache/tidegate/../tidegate",
    "/var/cache/tidegate/..",
    "/models",  # a read-only prefix is no cache
    "/models/cache",
]
ALLOWED_CACHES = ["/var/cache/tidegate", "/var/cache/tidegate/", "/var//cache/./tidegate"]


def resource(spec: dict[str, Any], name: str = "tiny") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": spec,
    }


def with_source(path: str) -> dict[str, Any]:
    return resource({"model": {"name": "m", "source": {"hostPath": {"path": path}}}})


def with_cache(path: str) -> dict[str, Any]:
    model = {"name": "m", "source": {"uri": "https://h.example/m.tar"}}
    return resource({"model": {**model, "cache": {"hostPath": {"path": path}}}})


def with_adapter(path: str) -> dict[str, Any]:
    spec = with_source("/models/m")["spec"]
    adapter = {"name": "chat", "source": {"hostPath": {"path": path}}}
    return resource({**spec, "adapters": [adapter]})


def refused_by_render(obj: dict[str, Any], field: str, flag: str) -> dict[str, Any]:
    """Render `obj` under POLICY: it must be refused; its Degraded condition."""
    with pytest.raises(SpecError) as refused:
        render(obj, RenderOptions(host_paths=POLICY))
    condition = degraded_condition(refused.value)
    assert condition["status"] == "True"
    if isinstance(refused.value, HostPathRefused):
        assert condition["reason"] == REASON
        assert field in condition["message"] and flag in condition["message"], condition
    else:  # the spec model refused it first ('..', or the root as a cache)
        assert condition["reason"] == "InvalidSpec", condition
    return condition


# -- the policy alone ------------------------------------------------------------------------


@pytest.mark.parametrize("path", HOSTILE_SOURCES)
def test_the_policy_refuses_each_hostile_source_and_names_the_flag(path: str) -> None:
    refusal_text = POLICY.refusal(path, is_cache=False)
    assert refusal_text is not None, f"{path!r} allowed"
    assert READ_ONLY_FLAG in refusal_text and "hostPaths.readOnly" in refusal_text


@pytest.mark.parametrize("path", HOSTILE_CACHES)
def test_the_policy_refuses_each_hostile_cache_and_names_the_flag(path: str) -> None:
    refusal_text = POLICY.refusal(path, is_cache=True)
    assert refusal_text is not None, f"{path!r} allowed"
    assert CACHE_FLAG in refusal_text and "hostPaths.cache" in refusal_text


@pytest.mark.parametrize("path", ALLOWED_SOURCES)
def test_the_policy_allows_sources_below_a_prefix_however_written(path: str) -> None:
    assert POLICY.refusal(path, is_cache=False) is None


@pytest.mark.parametrize("path", ALLOWED_CACHES)
def test_the_policy_allows_a_cache_folder_however_written(path: str) -> None:
    assert POLICY.refusal(path, is_cache=True) is None


def test_the_default_policy_allows_no_folder() -> None:
    for path in ["/", "/models", "/models/llama", CACHE]:
        assert "allowed: none" in (HostPathPolicy().refusal(path, is_cache=False) or "")
        assert "allowed: none" in (HostPathPolicy().refusal(path, is_cache=True) or "")


def test_the_message_shows_how_a_path_was_read() -> None:
    message = POLICY.refusal("//etc/", is_cache=False)
    assert message is not None and "'//etc/' (read as '/etc')" in message
    assert "allowed: /models, /srv/loras" in message
    message = POLICY.refusal("/models/../etc", is_cache=False)
    assert message is not None and "'..'" in message


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's folders as the operator would see them with links in them:
    models/out -> secret (outside), models/in -> models/real (inside), alias -> models."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "models" / "real").mkdir(parents=True)
    os.symlink(tmp_path / "secret", tmp_path / "models" / "out")
    os.symlink(tmp_path / "models" / "real", tmp_path / "models" / "in")
    os.symlink(tmp_path / "models", tmp_path / "alias")
    return tmp_path


def test_a_visible_link_out_of_an_allowed_prefix_is_refused(node: Path) -> None:
    policy = HostPathPolicy(read_only=(str(node / "models"), str(node / "alias")))
    secret = os.path.realpath(node / "secret")
    for path in (node / "models" / "out", node / "models" / "out" / "key", node / "alias" / "out"):
        message = policy.refusal(str(path), is_cache=False)
        assert message is not None, path
        assert f"link to '{secret}" in message
    # Links that stay inside, and a prefix that is itself a link, are fine.
    for path in (node / "models" / "in", node / "models" / "real", node / "alias" / "real"):
        assert policy.refusal(str(path), is_cache=False) is None, path


@pytest.mark.parametrize(
    ("read_only", "cache"),
    [
        (("/var",), (CACHE,)),
        ((CACHE,), (CACHE,)),
        ((f"{CACHE}/models",), (CACHE,)),
        (("/",), (CACHE,)),
        (("//var/cache/",), ("/var/cache/tidegate",)),
    ],
)
def test_a_read_only_prefix_may_not_overlap_a_cache_folder(read_only, cache) -> None:
    with pytest.raises(ValueError, match=f"{READ_ONLY_FLAG} .* and {CACHE_FLAG} .* overlap"):
        HostPathPolicy(read_only=read_only, cache=cache)


@pytest.mark.parametrize("prefix", ["models", "", "/models/../etc", "/.."])
def test_a_prefix_must_be_an_absolute_path_without_dots(prefix: str) -> None:
    with pytest.raises(ValueError):
        HostPathPolicy(read_only=(prefix,))


def test_prefixes_are_normalised() -> None:
    policy = HostPathPolicy(read_only=("//models/", "/models", "/srv/./loras"), cache=("/c//",))
    assert policy.read_only == ("/models", "/srv/loras")
    assert policy.cache == ("/c",)


# -- through render: Degraded, naming the field and the flag --------------------------------


@pytest.mark.parametrize("path", HOSTILE_SOURCES)
def test_a_hostile_model_source_is_refused(path: str) -> None:
    refused_by_render(with_source(path), "spec.model.source.hostPath.path", READ_ONLY_FLAG)


@pytest.mark.parametrize("path", HOSTILE_SOURCES)
def test_a_hostile_adapter_source_is_refused(path: str) -> None:
    refused_by_render(with_adapter(path), "spec.adapters[0].source.hostPath.path", READ_ONLY_FLAG)


@pytest.mark.parametrize("path", HOSTILE_CACHES)
def test_a_hostile_cache_is_refused(path: str) -> None:
    refused_by_render(with_cache(path), "spec.model.cache.hostPath.path", CACHE_FLAG)


def test_every_refused_path_of_a_resource_is_named() -> None:
    obj = with_adapter("/etc")
    obj["spec"]["model"]["source"] = {"hostPath": {"path": "/root"}}
    obj["spec"]["model"]["cache"] = {"hostPath": {"path": "/tmp"}}
    message = refused_by_render(obj, "spec.model.source.hostPath.path", READ_ONLY_FLAG)["message"]
    for field in ("spec.model.cache.hostPath.path", "spec.adapters[0].source.hostPath.path"):
        assert field in message


def test_allowed_paths_render_as_written() -> None:
    for path in ALLOWED_SOURCES:
        if ".." in path:
            continue  # the spec refuses any '..' in a path, a name with dots too
        for obj in (with_source(path), with_adapter(path)):
            checked = render(copy.deepcopy(obj), RenderOptions(host_paths=POLICY))
            assert checked.objects == render(obj).objects
            volumes = [
                v["hostPath"]["path"]
                for o in checked.objects
                if o["kind"] == "Deployment"
                for v in o["spec"]["template"]["spec"]["volumes"]
                if "hostPath" in v
            ]
            assert path in volumes  # the kubelet gets the path as the user wrote it
    for path in ALLOWED_CACHES:
        render(with_cache(path), RenderOptions(host_paths=POLICY))


def test_the_examples_render_once_their_folders_are_allowed() -> None:
    allowed = HostPathPolicy(read_only=(MODELS,))
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for obj in load_llm_deployments(path):
            obj["metadata"].update(namespace="ml", uid="uid-1")
            source = obj["spec"]["model"]["source"]
            assert render(copy.deepcopy(obj), RenderOptions(host_paths=allowed)).objects
            if "hostPath" in source:
                with pytest.raises(HostPathRefused):
                    render(obj, RenderOptions(host_paths=HostPathPolicy()))


def test_plan_and_up_apply_no_list() -> None:
    # They run as the user, on the user's own folders: no list, so "/" renders.
    assert RenderOptions().host_paths is None
    (rendered,) = plan([with_source("/")], RenderOptions())
    assert rendered.objects


# -- tidegate operator's flags --------------------------------------------------------------


def parse(*args: str) -> argparse.Namespace:
    return build_parser(only=["operator"]).parse_args(["operator", *args])


def test_the_operator_allows_no_host_path_without_flags() -> None:
    options = operator_options(parse())
    assert options.render.host_paths == HostPathPolicy()
    with pytest.raises(HostPathRefused):
        render(with_source("/models/m"), options.render)


def test_the_operator_flags_become_the_policy() -> None:
    ns = parse(
        "--allowed-host-path",
        "/models/",
        "--allowed-host-path",
        "/srv//loras",
        "--allowed-cache-host-path",
        CACHE,
    )
    policy = operator_options(ns).render.host_paths
    assert policy == HostPathPolicy(read_only=(MODELS, "/srv/loras"), cache=(CACHE,))


@pytest.mark.parametrize("flag", [READ_ONLY_FLAG, CACHE_FLAG])
@pytest.mark.parametrize("value", ["models", "/models/../etc"])
def test_the_operator_refuses_a_relative_or_dotted_folder(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(flag, value)
    assert flag in capsys.readouterr().err


def test_the_operator_refuses_overlapping_lists() -> None:
    ns = parse(READ_ONLY_FLAG, "/var", CACHE_FLAG, CACHE)
    with pytest.raises(ValueError, match="overlap"):
        operator_options(ns)
