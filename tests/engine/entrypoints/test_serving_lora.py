"""The watched adapter file: the server follows it, and an entry whose folder is not there yet
is served once it appears, with no change to the file."""

from __future__ import annotations

import shutil

import yaml

from tidegate.engine.entrypoints.openai.serving_lora import LoRAServing
from tidegate.engine.lora.registry import LoRARegistry
from tidegate.engine.lora.tiny_adapter import make_tiny_adapter
from tidegate.engine.model.config import ModelConfig


def test_the_file_is_followed_and_a_folder_that_appears_later_is_served(
    tiny_llama_dir, tmp_path, caplog
):
    registry = LoRARegistry(ModelConfig.from_pretrained(tiny_llama_dir), 16, ["base"])
    served: list[list[str]] = []
    loras = LoRAServing(registry, ["base"], on_change=served.append)
    ready = make_tiny_adapter(tiny_llama_dir, tmp_path / "ready", rank=4)
    late = tmp_path / "late"
    adapters = tmp_path / "adapters.yaml"
    entries = [{"name": "ready", "path": str(ready)}, {"name": "late", "path": str(late)}]
    adapters.write_text(yaml.safe_dump(entries))

    assert loras.sync_file(str(adapters)) is True
    assert served[-1] == ["ready"]
    assert loras.sync_file(str(adapters)) is False  # unchanged, and "late" still missing
    assert sum("cannot serve LoRA adapter 'late'" in r.message for r in caplog.records) == 1

    shutil.copytree(ready, late)  # the volume fills in after the list named it
    assert loras.sync_file(str(adapters)) is False
    assert served[-1] == ["ready", "late"]
    assert registry.get("late").path == str(late)

    adapters.write_text(yaml.safe_dump(entries[1:]))
    assert loras.sync_file(str(adapters)) is True
    assert served[-1] == ["late"]
