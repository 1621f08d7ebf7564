"""/classify, /score and /rerank over the scripted engine: shapes, pairs, order and refusals.

The scripted engine pools [prompt length, first ids...] (fake_engine.FakeEngine._pooled), so
what each route makes of the pooled outputs can be computed here by hand. That the real engine
pools and classifies as transformers does is tests/engine/test_classification.py's.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.engine.entrypoints.fake_engine import MODEL, SyncAPI, pooled_values
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.scoring import cosine_similarity, sigmoid, softmax


def classifier_folder(tiny_llama_dir, tmp_path, labels: list[str], **extra) -> str:
    """The tiny Llama's folder, its config.json saying it is a classifier of `labels`."""
    folder = tmp_path / f"cls-{len(labels)}"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    config["id2label"] = {str(i): label for i, label in enumerate(labels)}
    config.update(extra)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def classifier(engine, tiny_llama_dir, tmp_path):
    engine.pooled_size = 3
    folder = classifier_folder(tiny_llama_dir, tmp_path, ["neg", "neutral", "pos"])
    return SyncAPI(build_app(engine, served_model_names=[MODEL], model_path=folder))


@pytest.fixture
def reranker(engine, tiny_llama_dir, tmp_path):
    engine.pooled_size = 1
    folder = classifier_folder(tiny_llama_dir, tmp_path, ["LABEL_0"])
    return SyncAPI(build_app(engine, served_model_names=[MODEL], model_path=folder))


@pytest.fixture
def embedder(engine, tiny_llama_dir):
    return SyncAPI(build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir)))


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_gives_each_input_its_label_probabilities(classifier, engine, path):
    inputs = ["the cat", "sat on the mat"]
    response = classifier.post(path, {"model": MODEL, "input": inputs})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["id"].startswith("classify-")
    ids = [engine.tokenizer.encode(text) for text in inputs]
    for index, (item, prompt) in enumerate(zip(body["data"], ids, strict=True)):
        want = softmax(pooled_values(prompt, 3))
        assert item["index"] == index and item["num_classes"] == 3
        assert item["probs"] == pytest.approx(want)
        assert item["label"] == ["neg", "neutral", "pos"][want.index(max(want))]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids)) == body["usage"]["total_tokens"]
    # Each input ran as a pooling request of the last token: no text is generated.
    assert [r.sampling_params.pooling for r in engine.submitted] == ["last", "last"]
    assert all(r.sampling_params.max_tokens == 1 for r in engine.submitted)


def test_a_one_label_classifier_classifies_by_a_sigmoid(reranker):
    body = reranker.post("/classify", {"model": MODEL, "input": [[4, 4]]}).json()
    assert body["data"][0]["probs"] == pytest.approx([sigmoid(2.0)])
    assert body["data"][0]["label"] == "LABEL_0"


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_a_cross_encoder_scores_each_pair_read_as_one_prompt(reranker, engine, path):
    body = reranker.post(
        path, {"model": MODEL, "text_1": "the tide", "text_2": ["comes in", "goes out"]}
    ).json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    pairs = [engine.tokenizer.encode_pair("the tide", t) for t in ("comes in", "goes out")]
    assert [r.prompt_token_ids for r in engine.submitted] == pairs
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [sigmoid(pooled_values(p, 1)[0]) for p in pairs]
    )
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    assert body["usage"]["prompt_tokens"] == sum(map(len, pairs))
    # Two lists of one length: pairwise.
    pairwise = reranker.post(
        path, {"model": MODEL, "text_1": ["a", "bb"], "text_2": ["c", "dd"]}
    ).json()
    assert len(pairwise["data"]) == 2
    assert engine.submitted[-1].prompt_token_ids == engine.tokenizer.encode_pair("bb", "dd")


def test_a_cross_encoders_activation_comes_from_its_folder(engine, tiny_llama_dir, tmp_path):
    """sentence-transformers' CrossEncoder records it; Identity gives the raw logit."""
    engine.pooled_size = 1
    folder = classifier_folder(
        tiny_llama_dir,
        tmp_path,
        ["LABEL_0"],
        sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"},
    )
    api = SyncAPI(build_app(engine, served_model_names=[MODEL], model_path=folder))
    body = api.post("/score", {"model": MODEL, "text_1": "a", "text_2": "b"}).json()
    pair = engine.tokenizer.encode_pair("a", "b")
    assert body["data"][0]["score"] == pytest.approx(float(len(pair)))


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_descending_score(reranker, engine, path):
    documents = ["a", "a much longer document here", "mid length one"]
    body = reranker.post(
        path, {"model": MODEL, "query": "tide", "documents": documents, "top_n": 2}
    ).json()
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    scores = [sigmoid(len(engine.tokenizer.encode_pair("tide", d))) for d in documents]
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(scores[result["index"]])
        assert result["document"] == {"text": documents[result["index"]]}
    assert body["usage"]["total_tokens"] == sum(
        len(engine.tokenizer.encode_pair("tide", d)) for d in documents
    )
    # Without top_n (or with 0) every document comes back; return_documents false drops them.
    every = reranker.post(
        path, {"query": "tide", "documents": documents, "return_documents": False}
    ).json()
    assert len(every["results"]) == 3 and every["model"] == MODEL
    assert all(r["document"] is None for r in every["results"])


def test_an_embedding_model_scores_by_cosine_similarity(embedder, engine):
    body = embedder.post(
        "/score", {"model": MODEL, "text_1": "the tide", "text_2": ["comes in", "the tide"]}
    ).json()
    vectors = {t: pooled_values(engine.tokenizer.encode(t), 8) for t in ("the tide", "comes in")}
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [cosine_similarity(vectors["the tide"], vectors["comes in"]), 1.0]
    )
    # Each distinct text is embedded once.
    assert len(engine.submitted) == 2
    assert {r.sampling_params.pooling for r in engine.submitted} == {"last"}
    ranked = embedder.post(
        "/rerank", {"model": MODEL, "query": "the tide", "documents": ["comes in", "the tide"]}
    ).json()
    assert [r["index"] for r in ranked["results"]] == [1, 0]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(1.0)
    assert not math.isnan(ranked["results"][1]["relevance_score"])


@pytest.mark.parametrize(
    ("api_name", "path", "body", "message"),
    [
        ("embedder", "/classify", {"input": "a"}, "not a sequence classifier"),
        ("classifier", "/score", {"text_1": "a", "text_2": "b"}, "this classifier has 3 labels"),
        ("classifier", "/rerank", {"query": "a", "documents": ["b"]}, "has 3 labels"),
        ("classifier", "/v1/embeddings", {"input": "a"}, "serves a sequence classifier"),
        ("reranker", "/score", {"text_1": ["a", "b"], "text_2": ["c"] * 3}, "pairwise"),
        ("reranker", "/score", {"text_1": [], "text_2": "c"}, "must not be empty"),
        ("reranker", "/score", {"text_1": "a", "text_2": [1, 2]}, "list of strings"),
        ("reranker", "/rerank", {"query": "a", "documents": []}, "must not be empty"),
        ("reranker", "/rerank", {"query": "", "documents": ["b"]}, "query must not be empty"),
        ("reranker", "/rerank", {"query": "a", "documents": "b"}, "list of strings"),
        ("reranker", "/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("reranker", "/classify", {"input": ""}, "input must not be empty"),
        ("reranker", "/classify", {"input": [[10**9]]}, "outside this model's vocabulary"),
        ("reranker", "/score", {"text_1": "a", "text_2": ["b"] * 2049}, "at most 2048"),
        ("reranker", "/rerank", {"model": "other", "query": "a", "documents": ["b"]}, "other"),
    ],
)
def test_bad_scoring_requests_get_an_openai_4xx(request, engine, api_name, path, body, message):
    api = request.getfixturevalue(api_name)
    response = api.post(path, {"model": MODEL, **body})
    assert 400 <= response.status_code < 500, response.text
    assert message in response.json()["error"]["message"]
    assert engine.submitted == []  # refused before anything reached the engine
