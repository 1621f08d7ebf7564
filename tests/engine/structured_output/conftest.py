"""Both grammar backends over the tiny model's tokenizer, with logits wider than its vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.structured_output.corpus import BACKENDS
from tests.engine.structured_output.walk import EOS_ID, Vocab
from tidegate.engine.structured_output import StructuredOutputBackend, create_backend

# Logits beyond the tokenizer's ids, as models pad their vocabulary (the small model: 32,000
# logits over 3,967 tokens): the tiny model has none, so the tests add some.
PADDING = 100


@pytest.fixture(scope="session")
def vocab(tiny_llama_dir: Path) -> Vocab:
    """The tiny tokenizer's first bytes, over a padded vocabulary."""
    tokenizer = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    return Vocab(tiny_llama_dir, 1 + max(tokenizer["model"]["vocab"].values()) + PADDING)


@pytest.fixture(scope="session")
def backends(tiny_llama_dir: Path, vocab: Vocab) -> dict[str, StructuredOutputBackend]:
    """One backend of each library, built once."""
    return {
        name: create_backend(name, tiny_llama_dir, vocab.vocab_size, [EOS_ID]) for name in BACKENDS
    }


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, backends) -> StructuredOutputBackend:
    """Each backend in turn."""
    return backends[request.param]
