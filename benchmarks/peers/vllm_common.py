"""What the vLLM peer scripts share (they run in vLLM's venv and never import tidegate)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def offline_llm(model: Path, max_model_len: int, enable_prefix_caching: bool):
    """vLLM's offline LLM on `model` (an absolute path), bf16, seed 0, at its default compilation.

    vLLM starts helpers with `python -m`, which puts the working directory first on sys.path;
    in the repository root, its operator/ package would shadow the standard library's: the
    process moves to the temporary directory first (resolve relative paths before calling).
    """
    os.chdir(tempfile.gettempdir())
    from vllm import LLM

    return LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        seed=0,
    )
