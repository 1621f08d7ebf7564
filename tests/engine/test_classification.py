"""Sequence classifiers and pair scores (LLM.classify, LLM.score; scoring.py).

The reference is transformers' *ForSequenceClassification on the same folder (the decoder,
its final norm and a `score` head on the last token); a bi-encoder's scores are the cosine
similarities of transformers' base model's last hidden states.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine.test_embeddings import transformers_embeddings
from tests.engine.test_llm_vs_transformers import make_prompts, scheduled_llm
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.pooling import CLASSIFIER_POOLING
from tidegate.engine.scoring import (
    class_probabilities,
    cosine_similarity,
    read_score_activation,
    rerank_order,
    score_pairs,
    sigmoid,
)
from tidegate.engine.tiny_model import make_tiny_model

# (architecture, labels): a classifier, a reranker (one label) on tied embeddings, and Gemma 2
# (its final logit soft cap belongs to the LM head, which a classifier does not have).
CLASSIFIERS = [("llama", 3), ("qwen3", 1), ("gemma2", 2)]


def transformers_logits(model_dir: Path, prompts) -> list[list[float]]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return [model.eval()(torch.tensor([p])).logits[0].tolist() for p in prompts]


@pytest.fixture(scope="module", params=CLASSIFIERS, ids=[f"{a}-{n}" for a, n in CLASSIFIERS])
def classifier_dir(request, tmp_path_factory):
    arch, labels = request.param
    folder = tmp_path_factory.mktemp(f"{arch}-classifier")
    return make_tiny_model(folder, arch=arch, num_labels=labels)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reranker"), arch="llama", num_labels=1)


@pytest.mark.parametrize(("threshold", "budget"), [(7, "small"), (0, "large")])
def test_classifier_logits_equal_transformers(classifier_dir, threshold, budget):
    """In chunks of 7 tokens on a small pool, or whole prompts; with prefix caching, which
    last-token pooling uses. (Pooling across preemptions is test_embeddings.py's: the same
    chunks pool both.)"""
    vocab = json.loads((classifier_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab)
    llm = scheduled_llm(classifier_dir, True, threshold, budget == "small")
    outputs = llm.generate(prompts, CLASSIFIER_POOLING)
    for output, expected in zip(outputs, transformers_logits(classifier_dir, prompts), strict=True):
        assert output.pooled == pytest.approx(expected, abs=1e-4)
    stats = llm.stats()
    assert any(output.num_cached_tokens > 0 for output in outputs)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    classified = llm.classify(prompts[:3])
    labels = ModelConfig.from_pretrained(classifier_dir).labels
    for got, output in zip(classified, outputs, strict=False):
        assert got.logits == pytest.approx(output.pooled, abs=1e-5)
        assert got.probs == class_probabilities(got.logits)
        assert got.label == labels[got.probs.index(max(got.probs))]


def test_a_classifier_runs_no_lm_head_and_refuses_to_generate(reranker_dir):
    with LLM(str(reranker_dir), dtype="float32", max_model_len=256) as llm:
        model = llm.engine.executor.worker.runner.model
        assert model.lm_head is None and model.score is not None
        with pytest.raises(RuntimeError, match=r"no LM head"):
            model.compute_logits(torch.zeros(1, model.config.hidden_size))
        with pytest.raises(ValueError, match=r"sequence classifier: it classifies and scores"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match=r"labels' logits, not an embedding"):
            llm.embed("the tide")
        # What was refused left nothing behind.
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_cross_encoder_scores_equal_transformers_on_the_pair_encoding(reranker_dir):
    from transformers import AutoTokenizer

    query, documents = "the river runs", ["to the sea", "a tide gate holds the water", "x"]
    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    pairs = [tokenizer(query, document)["input_ids"] for document in documents]
    want = [sigmoid(logits[0]) for logits in transformers_logits(reranker_dir, pairs)]
    with LLM(str(reranker_dir), dtype="float32", max_model_len=256) as llm:
        got = llm.score(query, documents)
        assert [s.score for s in got] == pytest.approx(want, abs=1e-5)
        assert [s.num_prompt_tokens for s in got] == [len(p) for p in pairs]
        pairwise = llm.score([query, "tide"], [documents[0], documents[1]])
        assert pairwise[0].score == pytest.approx(want[0], abs=1e-5)
        assert llm.classify([pairs[1]])[0].probs == pytest.approx([want[1]], abs=1e-5)


def test_an_embedding_model_scores_by_cosine_similarity(tiny_llama_dir):
    texts = ["the river runs", "to the sea", "a tide gate"]
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256) as llm:
        ids = [llm.get_tokenizer().encode(text) for text in texts]
        got = llm.score(texts[0], texts[1:])
        with pytest.raises(ValueError, match=r"is not a sequence classifier"):
            llm.classify(texts)
    vectors = transformers_embeddings(tiny_llama_dir, ids, "last")
    want = [cosine_similarity(vectors[0].tolist(), v.tolist()) for v in vectors[1:]]
    assert [s.score for s in got] == pytest.approx(want, abs=1e-5)
    assert [s.num_prompt_tokens for s in got] == [len(ids[0]) + len(i) for i in ids[1:]]


def test_a_many_label_classifier_gives_no_score(tmp_path):
    folder = make_tiny_model(tmp_path / "three", arch="llama", num_labels=3)
    with (
        LLM(str(folder), dtype="float32", max_model_len=256) as llm,
        pytest.raises(ValueError, match=r"3 labels; a score comes from a one-label classifier"),
    ):
        llm.score("a", "b")


def test_labels_and_activations_as_transformers_and_sentence_transformers_read_them(tmp_path):
    def config(**raw) -> ModelConfig:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        base = json.loads((make_tiny_model(folder / "m", num_labels=2) / "config.json").read_text())
        return ModelConfig.from_dict({**{k: v for k, v in base.items() if k != "id2label"}, **raw})

    assert config(id2label={"1": "pos", "0": "neg"}).labels == ("neg", "pos")
    assert config(num_labels=4).labels == ("LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3")
    assert config().labels == ("LABEL_0", "LABEL_1")  # transformers' default of two
    assert config().architecture == "LlamaForCausalLM" and config().is_classifier
    with pytest.raises(ValueError, match=r"id2label must number its labels 0 to n-1"):
        config(id2label={"0": "a", "2": "b"})
    for raw, want in [
        ({}, "sigmoid"),
        (
            {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
            "identity",
        ),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, "tanh"),
    ]:
        folder = tmp_path / f"act-{want}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(raw))
        assert read_score_activation(folder, 1).name == want
    assert read_score_activation(tmp_path / "act-sigmoid", 3).name == "identity"
    (tmp_path / "act-sigmoid" / "config.json").write_text(
        json.dumps({"sentence_transformers": {"activation_fn": "torch.nn.GELU"}})
    )
    with pytest.raises(ValueError, match=r"names the score activation 'torch.nn.GELU'"):
        read_score_activation(tmp_path / "act-sigmoid", 1)


def test_pairs_orders_and_probabilities():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["p", "q"], ["a", "b"]) == [("p", "a"), ("q", "b")]
    with pytest.raises(ValueError, match=r"text_1 holds 2 texts and text_2 3"):
        score_pairs(["p", "q"], ["a", "b", "c"])
    assert rerank_order([0.1, 0.9, 0.5, 0.9], None) == [1, 3, 2, 0]  # ties keep their order
    assert rerank_order([0.1, 0.9, 0.5], 2) == [1, 2]
    assert rerank_order([0.1, 0.9, 0.5], 0) == [1, 2, 0]
    assert class_probabilities([1000.0, 0.0]) == pytest.approx([1.0, 0.0])  # no overflow
    assert class_probabilities([-1000.0]) == [0.0] and sigmoid(1000.0) == 1.0
    assert sum(class_probabilities([0.3, -1.2, 2.0])) == pytest.approx(1.0)
