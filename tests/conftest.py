"""Fixtures shared by all tests: tiny random-weight models written once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tidegate.engine.tiny_model import make_tiny_model

# Engines the tests start (here and in the servers they spawn) run eager unless a test asks
# for a level: compiling each one would cost the suite 6-35 s per engine. The compiled paths
# have their own tests (tests/engine/test_compilation.py, test_cuda_graphs.py).
os.environ.setdefault("TIDEGATE_COMPILATION_LEVEL", "0")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder (untied embeddings, no biases), seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 folder (q/k/v biases, tied embeddings), seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", size="tiny")
