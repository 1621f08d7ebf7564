"""LoRA adapters over HTTP: which `model` names an adapter, the runtime load and unload routes,
and the adapter file a mounted ConfigMap keeps (`--lora-modules-file`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import yaml

from tidegate.engine.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from tidegate.engine.lora.adapter import LoRAError
from tidegate.engine.lora.registry import (
    LoRAConflict,
    LoRANotFound,
    LoRARegistry,
    parse_lora_modules,
)
from tidegate.engine.messages import LoRARequest

logger = logging.getLogger("tidegate.lora")

# How often the adapter file is re-read: a ConfigMap volume updates within about a minute.
FILE_POLL_S = 2.0


class LoRAServing:
    """The served adapters of one server, and what changes them."""

    def __init__(
        self,
        registry: LoRARegistry,
        base_names: list[str],
        on_change: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.registry = registry
        self.base_names = base_names
        self._on_change = on_change or (lambda names: None)
        # Adapters the file asked for (name -> path), so that a name loaded through the API
        # is never unloaded because the file does not list it.
        self._from_file: dict[str, str] = {}
        self._file_text: str | None = None
        # The file's adapters that could not be loaded (name -> (path, why)): retried at every
        # read, since a folder may appear after the list names it (a volume still filling).
        self._failed: dict[str, tuple[str, str]] = {}

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model; 404 otherwise."""
        if name is None or name in self.base_names:
            return None
        lora = self.registry.get(name)
        if lora is None:
            raise model_not_found(name, self.served_names())
        return lora

    def served_names(self) -> list[str]:
        """The base model's names, then the adapters'."""
        return [*self.base_names, *(lora.name for lora in self.registry.adapters())]

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve a checked adapter; 400 for a bad folder, a rank too large or a taken name."""
        try:
            lora = self.registry.load(name, path)
        except (LoRAError, LoRAConflict) as error:
            raise bad_request(str(error), param="lora_path") from None
        logger.info("serving LoRA adapter %r from %s", name, lora.path)
        self._changed()
        return lora

    def unload(self, name: str) -> None:
        """Stop serving an adapter; 404 when none has that name."""
        try:
            self.registry.unload(name)
        except LoRANotFound as error:
            raise OpenAIError(404, str(error), param="lora_name", code="model_not_found") from None
        self._from_file.pop(name, None)
        logger.info("stopped serving LoRA adapter %r", name)
        self._changed()

    def load_flags(self, entries: list[str] | None) -> None:
        """The --lora-modules adapters, at start-up: a bad one stops the server (ValueError)."""
        for name, path in parse_lora_modules(entries).items():
            try:
                self.registry.load(name, path)
            except (LoRAError, LoRAConflict) as error:
                raise ValueError(f"--lora-modules {name}={path}: {error}") from None
        self._changed()

    def sync_file(self, path: str) -> bool:
        """Serve exactly the adapters the file lists (besides those loaded otherwise); True
        when the file changed since the last call. An entry that cannot be loaded is logged
        (once per reason) and tried again at the next call."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            if self._file_text is not None:
                logger.warning("cannot read --lora-modules-file %s: %s", path, error.strerror)
            self._file_text = None
            return False
        if text == self._file_text:
            if self._failed and self._load_from_file(dict(self._failed), path):
                self._changed()
            return False
        self._file_text = text
        wanted = _parse_adapter_file(text, path)
        if wanted is None:
            return True  # unreadable: keep serving what was served
        for name, old_path in list(self._from_file.items()):
            if wanted.get(name) != old_path and name in self.registry:
                self.registry.unload(name)
                del self._from_file[name]
                logger.info("stopped serving LoRA adapter %r (not in %s)", name, path)
        self._failed = {n: f for n, f in self._failed.items() if wanted.get(n) == f[0]}
        pending = {n: (p, "") for n, p in wanted.items() if n not in self._from_file}
        self._load_from_file(pending, path)
        self._changed()
        return True

    def _load_from_file(self, pending: dict[str, tuple[str, str]], path: str) -> bool:
        """Load the file's adapters not served yet; remember (and log once) those that fail.
        True when one was loaded."""
        loaded = False
        for name, (adapter_path, last_error) in pending.items():
            try:
                self.registry.load(name, adapter_path)
            except (LoRAError, LoRAConflict) as error:
                if str(error) != last_error:
                    logger.error("cannot serve LoRA adapter %r from %s: %s", name, path, error)
                self._failed[name] = (adapter_path, str(error))
                continue
            self._failed.pop(name, None)
            self._from_file[name] = adapter_path
            loaded = True
            logger.info("serving LoRA adapter %r from %s", name, adapter_path)
        return loaded

    async def watch_file(self, path: str, interval: float = FILE_POLL_S) -> None:
        """Re-read the adapter file until cancelled (content compared, so a ConfigMap's
        symlink swap is seen)."""
        while True:
            await asyncio.sleep(interval)
            self.sync_file(path)

    def _changed(self) -> None:
        self._on_change([lora.name for lora in self.registry.adapters()])


def _parse_adapter_file(text: str, path: str) -> dict[str, str] | None:
    """{name: path} from the file's YAML list of {name, path}; None (logged) when malformed."""
    try:
        data = yaml.safe_load(text) or []
    except yaml.YAMLError as error:
        logger.error("--lora-modules-file %s is not valid YAML: %s", path, error)
        return None
    if isinstance(data, dict) and "adapters" in data:
        data = data["adapters"] or []
    if not isinstance(data, list) or not all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and item.get("path")
        for item in data
    ):
        logger.error("--lora-modules-file %s must be a list of {name, path} mappings", path)
        return None
    return {item["name"]: str(item["path"]) for item in data}
