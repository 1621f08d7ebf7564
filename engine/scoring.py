"""Classification, pair scores and reranking: what a client gets from pooled outputs.

A sequence classifier (ModelConfig.is_classifier: transformers' *ForSequenceClassification)
pools its prompt's last final hidden state through its `score` head: the engine hands back
one logit per label. Classifying turns them into probabilities: a softmax over the labels, or
a sigmoid for a single label.

Two kinds of model score a pair of texts (vLLM's /score and /rerank):
- a classifier with one label (a cross-encoder, which is how rerankers are trained) reads the
  pair as one prompt, the tokenizer's pair encoding, and the score is its logit through the
  folder's activation: sentence-transformers' CrossEncoder records it in config.json, and
  without it a single label means a sigmoid;
- an embedding model (a bi-encoder) embeds each text alone, and the score is the cosine
  similarity of the two vectors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# sentence-transformers' activation classes (config.json), by what they do to a logit.
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def softmax(logits: Sequence[float]) -> list[float]:
    """Probabilities of the logits (shifted by their maximum, so none overflows)."""
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def class_probabilities(logits: Sequence[float]) -> list[float]:
    """A classifier's label probabilities: a softmax over its labels, a sigmoid for one."""
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    return softmax(logits)


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of the angle between two vectors (0 when either is zero)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return dot / norms if norms > 0 else 0.0


@dataclass(frozen=True)
class ScoreActivation:
    """How a cross-encoder's logit becomes its score: "sigmoid", "identity" or "tanh"."""

    name: str

    def __call__(self, logit: float) -> float:
        if self.name == "sigmoid":
            return sigmoid(logit)
        if self.name == "tanh":
            return math.tanh(logit)
        return logit


def read_score_activation(model_dir: str | Path, num_labels: int) -> ScoreActivation:
    """The folder's cross-encoder activation (sentence-transformers' config.json keys), else
    a sigmoid for one label and none for several, as sentence-transformers defaults."""
    config_file = Path(model_dir) / "config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    named = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function"
    )
    if named is None:
        return ScoreActivation("sigmoid" if num_labels == 1 else "identity")
    if named not in _ACTIVATIONS:
        raise ValueError(
            f"{model_dir}'s config.json names the score activation {named!r}; the engine "
            f"knows {', '.join(_ACTIVATIONS)}"
        )
    return ScoreActivation(_ACTIVATIONS[named])


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The pairs a score request means: one first text with each second text, or the two
    lists pairwise (of one length); a ValueError for anything else."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(
            f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 for "
            "every text_2, or lists of the same length (scored pairwise)"
        )
    return list(zip(firsts, seconds, strict=True))


def rerank_order(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Document indices by descending score (ties keep their order), the first `top_n` of
    them (all with None or 0)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n else order
