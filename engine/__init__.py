"""tidegate.engine: a vLLM-V1-style inference engine (unified scheduler, prefix caching).

Exports load lazily, so that `tidegate.engine.config` (read by the operator and the CLI) does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tidegate.engine.llm",
    "EngineArgs": "tidegate.engine.config",
    "SamplingParams": "tidegate.engine.sampling_params",
    "RequestOutput": "tidegate.engine.outputs",
    "CompletionOutput": "tidegate.engine.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidegate.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
