"""`tidegate up` and spec.adapters: the local adapters file, and the manifest followed into it.

No engine runs here: the engines' side (reading the file again when it changes) is the
engine's, and tests/e2e drives both with real processes. What is checked is what up does: the
file every engine is pointed at lists this machine's folders, an edit of spec.adapters in the
manifest rewrites it whole, and nothing is restarted (what would need a restart is only said).
"""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import cached_adapter_dir
from tidegate.operator.spec import parse_spec
from tidegate.operator.up import UpError, adapter_watcher, plan, plan_pods
from tidegate.operator.up_adapters import AdapterError, LocalAdapters, manifest_state

REPO = Path(__file__).resolve().parents[2]


def manifest(adapters: list[dict[str, Any]] | None, **spec: Any) -> dict[str, Any]:
    resource = copy.deepcopy(load_llm_deployments(REPO / "examples" / "disaggregated-tiny.yaml")[0])
    if adapters is not None:
        resource["spec"]["adapters"] = adapters
    resource["spec"].update(spec)
    return resource


def on_node(name: str, folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    return {"name": name, "source": {"hostPath": {"path": str(folder)}}}


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


class Up:
    """What `tidegate up -f FILE` sets up, less the processes: the pods planned and a watcher
    on the manifest, as run_up makes them."""

    def __init__(self, tmp_path: Path, resource: dict[str, Any], **claim_dirs: Path) -> None:
        self.file = tmp_path / "llm.yaml"
        self.write(resource)
        self.workdir = tmp_path / "up"
        self.pods, spec = plan(resource, Path("/m"), 9000, self.workdir, claim_dirs)
        self.adapters_path = self.workdir / "config" / "adapters.yaml"
        self.configs = {p.name: Path(flag(p.command, "--config")).read_text() for p in self.pods}
        self.commands = [list(p.command) for p in self.pods]
        self.watcher = adapter_watcher(self.file, resource, spec, self.workdir, claim_dirs)

    def write(self, resource: dict[str, Any]) -> None:
        self.file.write_text(yaml.safe_dump(resource, sort_keys=False))

    def listed(self) -> list[dict[str, str]]:
        return yaml.safe_load(self.adapters_path.read_text())

    def assert_nothing_restarted(self) -> None:
        """The pods are as planned: same commands, same config files, none started again."""
        assert [list(p.command) for p in self.pods] == self.commands
        assert all(p.restarts == 0 and p.server is None for p in self.pods)
        for pod in self.pods:
            assert Path(flag(pod.command, "--config")).read_text() == self.configs[pod.name]


def test_every_engine_reads_one_adapters_file_of_local_folders(tmp_path: Path) -> None:
    claim = tmp_path / "claim"
    (claim / "loras" / "sql").mkdir(parents=True)
    resource = manifest(
        [
            on_node("chat", tmp_path / "chat"),
            {"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "/loras/sql/"}}},
        ]
    )
    pods = plan_pods(resource, Path("/m"), 9000, tmp_path / "up", {"loras": claim})
    adapters_file = tmp_path / "up" / "config" / "adapters.yaml"
    assert yaml.safe_load(adapters_file.read_text()) == [
        {"name": "chat", "path": str(tmp_path / "chat")},
        {"name": "sql", "path": str(claim / "loras" / "sql")},
    ]
    for pod in pods:
        config = yaml.safe_load(Path(flag(pod.command, "--config")).read_text())
        if pod.role == "router":
            assert "lora-modules-file" not in config
        else:
            assert config["enable-lora"] is True
            assert config["lora-modules-file"] == str(adapters_file)


def test_an_adapter_this_machine_cannot_have_stops_up_at_the_start(tmp_path: Path) -> None:
    on_claim = {"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "sql"}}}
    with pytest.raises(UpError, match="give its local folder with --claim-dir loras=DIR"):
        plan_pods(manifest([on_claim]), Path("/m"), 9000, tmp_path / "up")
    missing = {"name": "chat", "source": {"hostPath": {"path": str(tmp_path / "nowhere")}}}
    with pytest.raises(UpError, match=f"adapter chat: folder {tmp_path / 'nowhere'} not found"):
        plan_pods(manifest([missing]), Path("/m"), 9000, tmp_path / "up")


def test_a_uri_adapter_is_fetched_into_the_local_cache_where_a_pod_would_have_it(
    tmp_path: Path,
) -> None:
    fetched: list[tuple[str, Path]] = []

    def fetch(uri: str, dest: Path) -> None:
        fetched.append((uri, dest))
        dest.mkdir(parents=True)

    uri = "https://loras.example/web.tar.gz"
    local = LocalAdapters(tmp_path / "cache", fetch=fetch)
    spec = parse_spec(manifest([{"name": "web", "source": {"uri": uri}}])["spec"])
    digest = Path(cached_adapter_dir(uri)).name
    assert local.entries(spec) == [("web", str(tmp_path / "cache" / "adapters" / digest))]
    assert fetched == [(uri, tmp_path / "cache" / "adapters" / digest)]


def test_an_adapter_added_to_the_manifest_rewrites_the_file_and_restarts_nothing(
    tmp_path: Path,
) -> None:
    chat = on_node("chat", tmp_path / "chat")
    up = Up(tmp_path, manifest([chat]))
    before = up.adapters_path.stat().st_ino
    assert up.watcher.poll() is None  # nothing changed yet

    sql = on_node("sql", tmp_path / "sql")
    up.write(manifest([chat, sql]))
    update = up.watcher.poll()
    assert update is not None
    assert (update.written, update.restart_needed, update.error) == (["chat", "sql"], [], None)
    assert up.listed() == [
        {"name": "chat", "path": str(tmp_path / "chat")},
        {"name": "sql", "path": str(tmp_path / "sql")},
    ]
    assert up.adapters_path.stat().st_ino != before  # a new file, renamed over the old one
    up.assert_nothing_restarted()

    # And removed again: the file lists only what is left.
    up.write(manifest([sql]))
    update = up.watcher.poll()
    assert update is not None and update.written == ["sql"] and update.restart_needed == []
    assert [a["name"] for a in up.listed()] == ["sql"]
    up.assert_nothing_restarted()


def test_a_save_while_the_engines_start_is_applied_by_the_watchers_first_look(
    tmp_path: Path,
) -> None:
    # run_up reads the manifest, starts the engines, then makes the watcher: a save in between
    # (a CI run saved it 0.4 s after the server answered) must not become the watcher's
    # baseline, or it would never be applied.
    chat, sql = on_node("chat", tmp_path / "chat"), on_node("sql", tmp_path / "sql")
    file, resource = tmp_path / "llm.yaml", manifest([chat])
    file.write_text(yaml.safe_dump(resource, sort_keys=False))
    started_from = manifest_state(file)
    workdir = tmp_path / "up"
    _, spec = plan(resource, Path("/m"), 9000, workdir)
    file.write_text(yaml.safe_dump(manifest([chat, sql]), sort_keys=False))
    watcher = adapter_watcher(file, resource, spec, workdir, started_from=started_from)
    update = watcher.poll()
    assert update is not None and update.written == ["chat", "sql"]
    assert watcher.poll() is None
    # Without the state from before the read, the watcher takes the file as it is now.
    file.write_text(yaml.safe_dump(manifest([chat, sql]), sort_keys=False))
    assert adapter_watcher(file, resource, spec, workdir).poll() is None


def test_other_changes_are_only_reported_as_needing_a_restart(tmp_path: Path) -> None:
    chat = on_node("chat", tmp_path / "chat")
    up = Up(tmp_path, manifest([chat]))
    before = up.adapters_path.read_text()
    up.write(manifest([chat], image="ghcr.io/tidegate/engine-cpu:0.2.0"))
    update = up.watcher.poll()
    assert update is not None and update.written is None
    assert update.restart_needed == ["the spec changed beyond spec.adapters"]
    assert up.adapters_path.read_text() == before
    up.assert_nothing_restarted()

    # Adapters dropped altogether: none served, and LoRA stays on until up restarts.
    up.write(manifest(None))
    update = up.watcher.poll()
    assert update is not None and update.written == [] and up.listed() == []
    assert update.restart_needed == [
        "spec.adapters is gone: the engines serve no adapter but keep LoRA on"
    ]
    up.assert_nothing_restarted()


def test_engines_started_without_lora_are_left_so(tmp_path: Path) -> None:
    up = Up(tmp_path, manifest(None))
    assert not up.adapters_path.exists()
    up.write(manifest([on_node("chat", tmp_path / "chat")]))
    update = up.watcher.poll()
    assert update is not None and update.written is None
    assert update.restart_needed == [
        "spec.adapters turns LoRA on, which the running engines started without"
    ]
    assert not up.adapters_path.exists()
    up.assert_nothing_restarted()


def test_a_refused_manifest_or_adapter_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    chat = on_node("chat", tmp_path / "chat")
    up = Up(tmp_path, manifest([chat]))
    before = up.adapters_path.read_text()
    up.write(manifest([chat, {**chat, "source": {"uri": "https://l/x.tar"}}]))
    update = up.watcher.poll()
    assert update is not None and update.error is not None
    assert "adapter names must be unique" in update.error
    missing = {"name": "gone", "source": {"hostPath": {"path": str(tmp_path / "gone")}}}
    up.write(manifest([chat, missing]))
    update = up.watcher.poll()
    assert (
        update is not None and update.error == f"adapter gone: folder {tmp_path / 'gone'} not found"
    )
    assert up.adapters_path.read_text() == before
    assert up.watcher.poll() is None  # not saved since: not tried again
    # The folder made, and the manifest saved again as it was: taken.
    (tmp_path / "gone").mkdir()
    saved = up.file.stat().st_mtime_ns
    up.write(manifest([chat, missing]))
    os.utime(up.file, ns=(saved + 10**9, saved + 10**9))
    update = up.watcher.poll()
    assert update is not None and update.written == ["chat", "gone"]


def test_the_watcher_follows_the_file_on_its_thread_until_stopped(tmp_path: Path) -> None:
    chat = on_node("chat", tmp_path / "chat")
    up = Up(tmp_path, manifest([]))
    assert up.listed() == []
    stopping = threading.Event()
    thread = threading.Thread(target=up.watcher.run, args=(stopping, 0.05))
    thread.start()
    try:
        up.write(manifest([chat]))
        deadline = time.monotonic() + 10
        while up.listed() == [] and time.monotonic() < deadline:
            time.sleep(0.05)  # polling with a deadline
        assert up.listed() == [{"name": "chat", "path": str(tmp_path / "chat")}]
    finally:
        stopping.set()
        thread.join(5)
    assert not thread.is_alive()
    up.assert_nothing_restarted()


def test_local_adapters_refuse_a_claim_without_a_folder() -> None:
    spec = parse_spec(
        manifest([{"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "sql"}}}])[
            "spec"
        ]
    )
    with pytest.raises(AdapterError, match="PersistentVolumeClaim loras"):
        LocalAdapters(Path("/cache")).entries(spec)
