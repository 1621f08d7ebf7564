"""The adapters a server (or an offline LLM) serves, by name: the one place names resolve.

An adapter is checked completely before it is registered (`adapter.read_adapter`), so a
request never names a half-loaded one. Each load gets a new id: workers cache weights by id,
so an adapter unloaded and loaded again (maybe from new files) is read afresh, while requests
already running under the old one finish with the weights they started with.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tidegate.engine.lora.adapter import AdapterInfo, LoRAError, read_adapter
from tidegate.engine.messages import LoRARequest
from tidegate.engine.model.config import ModelConfig


class LoRANotFound(LookupError):
    """A name that is not a served adapter."""


class LoRAConflict(ValueError):
    """A name already in use (by an adapter or the base model)."""


class LoRARegistry:
    """Adapter name -> LoRARequest, for the adapters this engine serves now."""

    def __init__(
        self, model_config: ModelConfig, max_lora_rank: int, reserved_names: list[str]
    ) -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.reserved_names = set(reserved_names)  # the base model's served names
        self._adapters: dict[str, LoRARequest] = {}
        self._info: dict[str, AdapterInfo] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served under `name`, or None."""
        return self._adapters.get(name)

    def require(self, name: str) -> LoRARequest:
        """The adapter served under `name`; LoRANotFound when there is none."""
        lora = self._adapters.get(name)
        if lora is None:
            raise LoRANotFound(f"no LoRA adapter named {name!r} is loaded")
        return lora

    def adapters(self) -> list[LoRARequest]:
        """The served adapters, in the order they were loaded."""
        return list(self._adapters.values())

    def rank(self, name: str) -> int:
        return self._info[name].rank

    def load(self, name: str, path: str | Path) -> LoRARequest:
        """Check the folder and serve it under `name`; LoRAError or LoRAConflict otherwise."""
        if not name or not name.strip():
            raise LoRAError("an adapter needs a non-empty name")
        if name in self.reserved_names:
            raise LoRAConflict(f"{name!r} is the base model's name; give the adapter another")
        if name in self._adapters:
            raise LoRAConflict(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        info = read_adapter(path, self.model_config, self.max_lora_rank)
        lora = LoRARequest(name=name, lora_id=next(self._ids), path=info.path, digest=info.digest)
        self._adapters[name] = lora
        self._info[name] = info
        return lora

    def unload(self, name: str) -> LoRARequest:
        """Stop serving `name` (requests running under it finish); LoRANotFound otherwise."""
        lora = self.require(name)
        del self._adapters[name]
        del self._info[name]
        return lora


def parse_lora_modules(entries: list[str] | None) -> dict[str, str]:
    """`name=path` flags as {name: path}; a ValueError names a malformed or repeated entry."""
    modules: dict[str, str] = {}
    for entry in entries or []:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules entry {entry!r} is not name=path")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name.strip()] = path.strip()
    return modules
