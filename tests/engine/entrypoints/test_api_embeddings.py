"""POST /v1/embeddings over the scripted engine: the request's shapes, the vector's finishing
and encoding, and refusals. The engine's pooling itself is tested in tests/engine."""

from __future__ import annotations

import base64
import json
import math
import shutil

import numpy as np
import pytest

from tests.engine.entrypoints.fake_engine import EMBEDDING_SIZE, MODEL, SyncAPI, pooled_values
from tidegate.engine.entrypoints.openai.api_server import build_app


def unit(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def test_every_input_shape_gets_its_vector_in_order(api, engine):
    ids = engine.tokenizer.encode("the cat sat")
    texts = ["the cat sat", "on the mat", "a dog"]
    for given, prompts in [
        ("the cat sat", [ids]),
        (texts, [engine.tokenizer.encode(t) for t in texts]),
        (ids, [ids]),
        ([ids, [5, 6]], [ids, [5, 6]]),
    ]:
        engine.submitted.clear()
        body = api.post("/v1/embeddings", {"model": MODEL, "input": given}).json()
        assert body["object"] == "list" and body["model"] == MODEL
        assert body["id"].startswith("embd-")
        assert [item["index"] for item in body["data"]] == list(range(len(prompts)))
        for item, prompt in zip(body["data"], prompts, strict=True):
            assert item["object"] == "embedding"
            assert item["embedding"] == pytest.approx(unit(pooled_values(prompt)))
        count = sum(len(p) for p in prompts)
        assert body["usage"] == {"prompt_tokens": count, "total_tokens": count}
        # One greedy token each, pooled as the folder says (no modules.json: the last token).
        for request in engine.submitted:
            params = request.sampling_params
            assert (params.pooling, params.max_tokens, params.greedy) == ("last", 1, True)


def test_dimensions_normalize_and_base64(api, engine):
    ids = engine.tokenizer.encode("the cat sat")
    raw = pooled_values(ids)
    ask = {"model": MODEL, "input": "the cat sat"}
    cut = api.post("/v1/embeddings", {**ask, "dimensions": 3}).json()["data"][0]["embedding"]
    assert cut == pytest.approx(unit(raw[:3]))
    plain = api.post("/v1/embeddings", {**ask, "normalize": False}).json()["data"][0]
    assert plain["embedding"] == raw
    encoded = api.post("/v1/embeddings", {**ask, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(unit(raw), rel=1e-6)
    # null is the default, as OpenAI's reference allows.
    nulls = {**ask, "encoding_format": None, "dimensions": None, "user": None}
    assert api.post("/v1/embeddings", nulls).json()["data"][0]["embedding"] == pytest.approx(
        unit(raw)
    )


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "the cat", "dimensions": EMBEDDING_SIZE + 1}, 400, "dimensions must be"),
        ({"input": []}, 400, "input must not be empty"),
        ({"input": ["the cat", ""]}, 400, "input must not be empty"),
        ({"input": [1.5]}, 400, "input"),
        ({"input": "the cat", "model": "other"}, 404, "other"),
        ({}, 400, "input is required"),
    ],
)
def test_refusals_are_openai_errors_and_reach_no_engine(api, engine, body, status, message):
    response = api.post("/v1/embeddings", {"model": MODEL, **body})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    if status == 404 or "dimensions" not in body:
        assert engine.submitted == []


def test_a_folder_that_pools_otherwise_serves_completions_but_no_embeddings(
    engine, tiny_llama_dir, tmp_path
):
    folder = tmp_path / "cls"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    modules = [{"idx": 0, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    api = SyncAPI(build_app(engine, served_model_names=[MODEL], model_path=str(folder)))
    refused = api.post("/v1/embeddings", {"model": MODEL, "input": "the cat"})
    assert refused.status_code == 400
    assert "this server embeds nothing" in refused.json()["error"]["message"]
    assert "choose one with --pooling" in refused.json()["error"]["message"]
    assert api.post("/v1/completions", {"model": MODEL, "prompt": "a"}).status_code == 200
    # --pooling mean serves it, normalised as its modules.json says (no Normalize: not).
    api = SyncAPI(
        build_app(engine, served_model_names=[MODEL], model_path=str(folder), pooling="mean")
    )
    body = api.post("/v1/embeddings", {"model": MODEL, "input": [4, 5]}).json()
    assert body["data"][0]["embedding"] == pooled_values([4, 5])
    assert engine.submitted[-1].sampling_params.pooling == "mean"
