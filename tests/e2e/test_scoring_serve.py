"""A served reranker (a one-label sequence classifier): /rerank, /score and /classify over
HTTP equal the offline engine, and what a classifier cannot do is an OpenAI 400."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import API_KEY, CLIENT_FLAGS, SERVED_NAME
from tests.e2e.server import ServerProcess, serving
from tidegate.engine import LLM
from tidegate.engine.tiny_model import make_tiny_model

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
QUERY = "the river runs"
DOCUMENTS = ["to the sea", "a tide gate holds the water back", "x", "the river runs"]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reranker"), arch="llama", num_labels=1)


@pytest.fixture(scope="module")
def server(reranker_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        reranker_dir, tmp_path_factory.mktemp("logs"), *CLIENT_FLAGS, "--max-model-len", "256"
    )
    yield from serving(proc)


@pytest.fixture(scope="module")
def offline(reranker_dir) -> Iterator[LLM]:
    with LLM(str(reranker_dir), dtype="float32", max_model_len=256) as llm:
        yield llm


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60)


def test_rerank_score_and_classify_equal_the_offline_engine(server, offline):
    want = [s.score for s in offline.score(QUERY, DOCUMENTS)]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(server, path, {"model": SERVED_NAME, "query": QUERY, "documents": DOCUMENTS})
        assert body.status_code == 200, body.text
        results = body.json()["results"]
        assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -want[i])
        for result in results:
            assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-4)
            assert result["document"]["text"] == DOCUMENTS[result["index"]]
    scored = post(server, "/v1/score", {"model": SERVED_NAME, "text_1": QUERY, "text_2": DOCUMENTS})
    assert [d["score"] for d in scored.json()["data"]] == pytest.approx(want, abs=1e-4)
    classified = post(server, "/classify", {"model": SERVED_NAME, "input": DOCUMENTS[:2]}).json()
    expected = offline.classify(DOCUMENTS[:2])
    for item, output in zip(classified["data"], expected, strict=True):
        assert item["probs"] == pytest.approx(output.probs, abs=1e-4)
        assert item["label"] == output.label == "LABEL_0"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "the tide", "max_tokens": 4}, "sequence classifier"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "classifier"),
        ("/v1/embeddings", {"input": "the tide"}, "serves a sequence classifier"),
        (
            "/rerank",
            {"query": "a", "documents": ["b" * 2000]},
            "2,003 tokens; this model classifies at most 255",
        ),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "pairwise"),
    ],
)
def test_what_a_classifier_cannot_do_is_an_openai_400(server, path, body, message):
    response = post(server, path, {"model": SERVED_NAME, **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
