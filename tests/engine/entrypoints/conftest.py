"""The real API app over a scripted engine: real tokenizer and input checks, fake generation."""

from __future__ import annotations

import pytest

from tests.engine.entrypoints.fake_engine import MAX_MODEL_LEN, MODEL, FakeEngine, SyncAPI
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.input_processor import InputProcessor, model_eos_token_ids
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_input_processor(tiny_llama_dir) -> InputProcessor:
    tokenizer = Tokenizer(tiny_llama_dir)
    config = ModelConfig.from_pretrained(tiny_llama_dir)
    return InputProcessor(
        tokenizer=tokenizer,
        vocab_size=config.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=model_eos_token_ids(config, tokenizer),
    )


@pytest.fixture
def engine(tiny_input_processor) -> FakeEngine:
    return FakeEngine(tiny_input_processor.tokenizer, tiny_input_processor)


@pytest.fixture
def app(engine, tiny_llama_dir):
    return build_app(engine, served_model_names=[MODEL, "alias"], model_path=str(tiny_llama_dir))


@pytest.fixture
def api(app) -> SyncAPI:
    return SyncAPI(app)
