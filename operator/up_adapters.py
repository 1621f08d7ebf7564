"""`tidegate up` and spec.adapters: the local adapters file, kept in step with the manifest.

As in a cluster, every engine runs with `lora-modules-file` naming one adapters file (here
`<workdir>/config/adapters.yaml`, where the ConfigMap's other files are) and reads it again
when it changes. `tidegate up` writes that file with this machine's folders instead of the
pods' mounts: a hostPath adapter is that folder, a pvc one the folder given for its claim
with `--claim-dir CLAIM=DIR` (plus its path), and a uri one is fetched by `tidegate fetch-model
--shared` into the local model cache (`<cache>/adapters/<digest of the URI>`, where a pod with
spec.model.cache has it).

`AdapterWatcher` then looks at the manifest every second, and reads it again once it was saved
(its modification time or its text changed). When its spec.adapters changed,
it rewrites the adapters file (a new file renamed over the old, so an engine never reads half
of one) and restarts nothing: the engines load and unload adapters themselves. What only a
restart of `tidegate up` can run (any other change of the spec; LoRA turned on for engines
started without it) is logged as such, and left alone. A manifest that is refused, or an
adapter whose folder is missing or whose fetch fails, leaves the file as it was; saving the
manifest again (once the folder is there, say) tries again.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tidegate.common.local_server import tidegate_command
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import CACHE_DIR, adapters_file, cached_adapter_dir
from tidegate.operator.spec import AdapterSpec, LLMDeploymentSpec, SpecError, parse_spec

logger = logging.getLogger("tidegate.up")

POLL_S = 1.0


class AdapterError(Exception):
    """An adapter this machine cannot serve, said so that the user can fix it."""


def fetch_adapter(uri: str, dest: Path) -> None:
    """`tidegate fetch-model --shared URI DEST`, the init container's fetch, as a process."""
    command = [*tidegate_command(), "fetch-model", "--shared", uri, str(dest)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise AdapterError(f"fetching {uri} failed: {said[0]}")


@dataclass(frozen=True)
class LocalAdapters:
    """Where spec.adapters are on this machine."""

    cache_dir: Path  # stands for spec.model.cache: fetched adapters go to its adapters/
    claim_dirs: Mapping[str, Path] = field(default_factory=dict)
    fetch: Callable[[str, Path], None] = fetch_adapter

    def entries(self, spec: LLMDeploymentSpec) -> list[tuple[str, str]]:
        """(name, local folder) of every adapter, in the spec's order; AdapterError if one
        cannot be had here."""
        return [(adapter.name, str(self.folder(adapter))) for adapter in spec.adapters or []]

    def folder(self, adapter: AdapterSpec) -> Path:
        """An adapter's local folder, fetched first for a uri source."""
        source = adapter.source
        if source.pvc is not None:
            claim = source.pvc.claim_name
            root = self.claim_dirs.get(claim)
            if root is None:
                raise AdapterError(
                    f"adapter {adapter.name} is on PersistentVolumeClaim {claim}, which only a "
                    f"cluster has: give its local folder with --claim-dir {claim}=DIR"
                )
            path = root / source.pvc.path.strip("/")
        elif source.host_path is not None:
            path = Path(source.host_path.path)
        else:
            assert source.uri is not None
            path = Path(cached_adapter_dir(source.uri).replace(CACHE_DIR, str(self.cache_dir), 1))
            self.fetch(source.uri, path)
        if not path.is_dir():
            raise AdapterError(f"adapter {adapter.name}: folder {path} not found")
        return path


def write_adapters_file(path: Path, entries: list[tuple[str, str]]) -> None:
    """Write the adapters file whole: a new file renamed over the old one."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(adapters_file(entries), encoding="utf-8")
    os.replace(partial, path)


def read_adapters_file(path: Path) -> list[tuple[str, str]]:
    """The (name, folder) pairs an adapters file lists; none when there is no such file."""
    if not path.is_file():
        return []
    return [(entry["name"], entry["path"]) for entry in yaml.safe_load(path.read_text()) or []]


@dataclass(frozen=True)
class Update:
    """What one look at the manifest found."""

    # The adapters the file lists now, when it was rewritten (None: left as it was).
    written: list[str] | None = None
    # Changes that only a restart of `tidegate up` would run; up restarts nothing itself.
    restart_needed: list[str] = field(default_factory=list)
    # Why the manifest or an adapter was not taken (the file is left as it was).
    error: str | None = None


def _beside_adapters(resource: Mapping[str, Any]) -> Any:
    """The resource less spec.adapters: what the running engines were started from."""
    spec = {k: v for k, v in (resource.get("spec") or {}).items() if k != "adapters"}
    meta = resource.get("metadata") or {}
    return meta.get("name"), meta.get("namespace"), spec


def manifest_state(file: Path) -> tuple[int, str]:
    """A manifest's modification time and text: a save changes one or both."""
    return file.stat().st_mtime_ns, file.read_text(encoding="utf-8")


class AdapterWatcher:
    """Follows spec.adapters in the manifest `tidegate up` runs, into the engines' file."""

    def __init__(
        self,
        file: Path,
        resource: Mapping[str, Any],
        local: LocalAdapters,
        adapters_path: Path,
        written: list[tuple[str, str]],
        started_from: tuple[int, str] | None = None,
    ) -> None:
        self.file = file
        self.local = local
        self.adapters_path = adapters_path
        # The manifest as `resource` was read from it (manifest_state before the read): a save
        # while the engines start, before this watcher exists, is still a change to apply.
        self._seen = started_from if started_from is not None else self._saved()
        self._started = _beside_adapters(resource)
        self._lora = (resource.get("spec") or {}).get("adapters") is not None
        self._written = written
        # Under rollout.strategy canary the other changes of the spec are up_rollout's.
        self.others_followed = False

    def _saved(self) -> tuple[int, str]:
        return manifest_state(self.file)

    def poll(self) -> Update | None:
        """Look at the manifest once; None when it was not saved since the last look."""
        try:
            saved = self._saved()
        except OSError as error:  # an editor's save in progress; the next look sees it
            return Update(error=f"cannot read {self.file}: {error}")
        if saved == self._seen:
            return None
        self._seen = saved
        try:
            resources = load_llm_deployments(self.file)
            if len(resources) != 1:
                raise SpecError(f"{self.file} holds {len(resources)} LLMDeployments; up runs one")
            resource = resources[0]
            spec = parse_spec(resource.get("spec") or {})
        except SpecError as error:
            return Update(error=str(error))
        restart = []
        if _beside_adapters(resource) != self._started and not self.others_followed:
            restart.append("the spec changed beyond spec.adapters")
        if spec.adapters is not None and not self._lora:
            restart.append("spec.adapters turns LoRA on, which the running engines started without")
            return Update(restart_needed=restart)
        if spec.adapters is None and self._lora:
            restart.append("spec.adapters is gone: the engines serve no adapter but keep LoRA on")
        try:
            entries = self.local.entries(spec)
        except AdapterError as error:
            return Update(restart_needed=restart, error=str(error))
        if entries == self._written:
            return Update(restart_needed=restart)
        write_adapters_file(self.adapters_path, entries)
        self._written = entries
        return Update(written=[name for name, _ in entries], restart_needed=restart)

    def run(self, stopping: threading.Event, poll_s: float = POLL_S) -> None:
        """poll() every `poll_s` until `stopping`, saying what each look did."""
        while not stopping.wait(poll_s):
            update = self.poll()
            if update is None:
                continue
            if update.error is not None:
                logger.error(
                    "%s: not applied (save it again to retry): %s", self.file, update.error
                )
            if update.written is not None:
                logger.info(
                    "adapters: %s now listed in %s; the engines load and unload them, "
                    "no process restarts",
                    ", ".join(update.written) or "none",
                    self.adapters_path,
                )
            for change in update.restart_needed:
                logger.warning("%s: %s; restart tidegate up to run it", self.file, change)
