"""Embeddings: how a model folder pools its hidden states, and the vector a client gets.

The engine pools (SamplingParams.pooling: the last prompt token's final hidden state, or
their mean over the prompt); what it hands back is the raw vector. This module reads which
pooling a folder was trained with and finishes the vector as a request asks: the leading
`dimensions` kept (Matryoshka models), then scaled to unit length unless told not to.

A sentence-transformers folder says how it pools: `modules.json` lists a Pooling module
(its `config.json` sets one `pooling_mode_*`) and, when the vectors are normalised, a
Normalize module. Decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) pool
the last token and normalise; a folder without modules.json gets that too, as vLLM gives it.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidegate.engine.sampling_params import SamplingParams

# sentence-transformers' pooling modes -> the engine's; the others are refused.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """How a served model's embeddings are made: "last" or "mean", and normalised or not."""

    pooling: str
    normalize: bool

    def sampling_params(self) -> SamplingParams:
        """How an input is run to be embedded: greedy, ended by the one token it samples,
        which carries the pooled vector (SamplingParams.pooling)."""
        return SamplingParams(temperature=0.0, max_tokens=1, pooling=self.pooling)


# How a sequence classifier's prompt is run: its last token's final hidden state, which the
# runner passes through the classifier's score head (ModelRunner._pooled_vector).
CLASSIFIER_POOLING = SamplingParams(temperature=0.0, max_tokens=1, pooling="last")


def read_pooling_config(model_dir: str | Path, pooling: str = "auto") -> PoolingConfig:
    """The folder's pooling, or `pooling` ("last", "mean") when it is not "auto"; a ValueError
    names a folder's pooling the engine does not do (CLS, max, weighted mean: encoder models'
    ways, which serve no decoder model)."""
    if pooling not in ("auto", "last", "mean"):
        raise ValueError(f"pooling must be auto, last or mean, got {pooling!r}")
    folder = Path(model_dir)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig("last" if pooling == "auto" else pooling, True)
    modules = json.loads(modules_file.read_text())
    types = [module.get("type") for module in modules]
    normalize = _NORMALIZE_MODULE in types
    if pooling != "auto":
        return PoolingConfig(pooling, normalize)
    module = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    if module is None:
        return PoolingConfig("last", normalize)
    config = json.loads((folder / module.get("path", "") / "config.json").read_text())
    chosen = [mode for mode, value in config.items() if mode.startswith("pooling_mode_") and value]
    if len(chosen) != 1 or chosen[0] not in _MODES:
        raise ValueError(
            f"{folder} pools by {', '.join(chosen) or 'nothing'} (its sentence-transformers "
            "Pooling config); the engine pools by the last token or the mean of the tokens: "
            "choose one with --pooling"
        )
    return PoolingConfig(_MODES[chosen[0]], normalize)


def check_dimensions(dimensions: int | None, size: int) -> None:
    """A ValueError unless `dimensions` is None or keeps 1 to `size` (the hidden size) values."""
    if dimensions is not None and not 1 <= dimensions <= size:
        raise ValueError(
            f"dimensions must be between 1 and {size} (the model's embedding size), "
            f"got {dimensions}"
        )


def finish_embedding(
    vector: list[float], normalize: bool, dimensions: int | None = None
) -> list[float]:
    """The vector a client gets: its first `dimensions` values (all with None), then scaled to
    unit length when `normalize` (a zero vector stays zero)."""
    check_dimensions(dimensions, len(vector))
    if dimensions is not None:
        vector = vector[:dimensions]
    if not normalize:
        return list(vector)
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / max(norm, 1e-12) for x in vector]  # torch's F.normalize guards by 1e-12


def base64_embedding(vector: list[float]) -> str:
    """OpenAI's encoding_format "base64": the vector's float32 values, little-endian, in base64."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
