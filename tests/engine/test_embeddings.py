"""Embeddings (SamplingParams.pooling, LLM.embed): the prompt's final hidden states pooled.

The reference is transformers' base model on the same folder (AutoModel: the decoder stack
and its final norm, no LM head), pooled and normalised as sentence-transformers does it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.engine.test_llm_vs_transformers import make_prompts, scheduled_llm
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.pooling import (
    PoolingConfig,
    base64_embedding,
    finish_embedding,
    read_pooling_config,
)

ARCHITECTURES = ["llama", "qwen3", "gemma3"]


def transformers_embeddings(model_dir: Path, prompts, pooling: str) -> list[torch.Tensor]:
    """Unnormalised: each prompt's last hidden state, or their mean."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            vectors.append(hidden[-1] if pooling == "last" else hidden.mean(dim=0))
    return vectors


def prompts_for(model_dir: Path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return make_prompts(vocab)  # 1 to 330 tokens, three sharing a 100-token prefix


def unit(vector: torch.Tensor) -> list[float]:
    return torch.nn.functional.normalize(vector, dim=0).tolist()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize(
    ("caching", "threshold", "budget"), [(True, 7, "small"), (True, 0, "large")]
)
def test_pooled_hidden_states_equal_transformers(model_dir, pooling, caching, threshold, budget):
    """Embedded beside completions of the same prompts: chunks of 7 tokens on a pool too small
    for the batch (preemption recomputes chunks), or whole prompts; with prefix caching, which
    last-token pooling uses and mean pooling skips."""
    prompts = prompts_for(model_dir)
    llm = scheduled_llm(model_dir, caching, threshold, budget == "small")
    embed = SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)
    complete = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outputs = llm.generate(prompts * 2, [embed] * len(prompts) + [complete] * len(prompts))
    want = transformers_embeddings(model_dir, prompts, pooling)
    for output, expected in zip(outputs, want, strict=False):
        assert output.pooled == pytest.approx(expected.tolist(), abs=1e-4)
        assert len(output.outputs[0].token_ids) == 1
    assert all(output.pooled is None for output in outputs[len(prompts) :])
    stats = llm.stats()
    if budget == "small":
        assert stats["num_preemptions"] > 0, "the small budget was meant to force preemption"
    embedded = outputs[: len(prompts)]
    if pooling == "mean":
        assert all(output.num_cached_tokens == 0 for output in embedded)
    else:
        assert any(output.num_cached_tokens > 0 for output in embedded)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_embed_pools_and_normalises_as_the_folder_says(tiny_qwen3_dir, tmp_path):
    prompts = prompts_for(tiny_qwen3_dir)[:4]
    last = transformers_embeddings(tiny_qwen3_dir, prompts, "last")
    mean = transformers_embeddings(tiny_qwen3_dir, prompts, "mean")
    with LLM(str(tiny_qwen3_dir), dtype="float32", max_model_len=512) as llm:
        # No modules.json: the last token, normalised (decoder embedding models' way).
        got = llm.embed(prompts)
        for output, prompt, expected in zip(got, prompts, last, strict=True):
            assert output.prompt_token_ids == prompt
            assert output.embedding == pytest.approx(unit(expected), abs=1e-5)
        raw = llm.embed(prompts[1], pooling="mean", normalize=False)[0].embedding
        assert raw == pytest.approx(mean[1].tolist(), abs=1e-4)
        # Matryoshka: the first 16 values, normalised again.
        short = llm.embed(prompts[1], dimensions=16)[0].embedding
        assert short == pytest.approx(unit(last[1][:16]), abs=1e-5)
        with pytest.raises(ValueError, match=r"dimensions must be between 1 and 128"):
            llm.embed(prompts[1], dimensions=129)
        with pytest.raises(ValueError, match=r"the input has 600 tokens; this model embeds at"):
            llm.embed([1] * 600)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_sentence_transformers_folders(tmp_path):
    def folder(name: str, modules: list[str], pooling: dict[str, bool] | None) -> Path:
        path = tmp_path / name
        (path / "1_Pooling").mkdir(parents=True)
        kinds = {"pool": "sentence_transformers.models.Pooling"}
        kinds["norm"] = "sentence_transformers.models.Normalize"
        entries = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
        for module in modules:
            path_of = "1_Pooling" if module == "pool" else "2_Normalize"
            entries.append({"idx": len(entries), "path": path_of, "type": kinds[module]})
        (path / "modules.json").write_text(json.dumps(entries))
        if pooling is not None:
            (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return path

    qwen3_embedding = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    mean = {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}
    assert read_pooling_config(folder("q", ["pool", "norm"], qwen3_embedding)) == PoolingConfig(
        "last", True
    )
    assert read_pooling_config(folder("m", ["pool"], mean)) == PoolingConfig("mean", False)
    assert read_pooling_config(folder("m2", ["pool"], mean), "last") == PoolingConfig("last", False)
    assert read_pooling_config(tmp_path / "none") == PoolingConfig("last", True)
    cls = folder("c", ["pool", "norm"], {"pooling_mode_cls_token": True})
    with pytest.raises(ValueError, match=r"pools by pooling_mode_cls_token .* choose one with"):
        read_pooling_config(cls)
    assert read_pooling_config(cls, "mean") == PoolingConfig("mean", True)
    with pytest.raises(ValueError, match="pooling must be auto, last or mean"):
        read_pooling_config(cls, "max")


def test_finishing_a_vector():
    assert finish_embedding([3.0, 4.0, 12.0], normalize=True) == pytest.approx(
        [3 / 13, 4 / 13, 12 / 13]
    )
    assert finish_embedding([3.0, 4.0, 12.0], normalize=True, dimensions=2) == pytest.approx(
        [0.6, 0.8]
    )
    assert finish_embedding([3.0, 4.0], normalize=False, dimensions=1) == [3.0]
    assert finish_embedding([0.0, 0.0], normalize=True) == [0.0, 0.0]
    with pytest.raises(ValueError, match="between 1 and 2"):
        finish_embedding([1.0, 2.0], normalize=True, dimensions=0)
    import base64

    import numpy as np

    encoded = base64_embedding([0.5, -1.25, math.pi])
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist()
    assert decoded == pytest.approx([0.5, -1.25, math.pi], rel=1e-7)
    with pytest.raises(ValueError, match="pooling must be one of None, last, mean"):
        SamplingParams(pooling="cls")


@pytest.mark.parametrize("speculative", [False, True])
def test_pooling_requests_skip_the_lm_head(tiny_llama_dir, speculative):
    """A pooling request's one token only ends it: its row never reaches the LM head, and the
    completions sampled beside it (with n-gram guesses too) are those of a batch without it."""
    from tests.engine.test_spec_decode_model import SPEC

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10]]
    complete = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    embed = SamplingParams(temperature=0.0, max_tokens=1, pooling="last")
    args = SPEC if speculative else {}
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, **args) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, complete)]
        model = llm.engine.executor.worker.runner.model
        rows: list[int] = []
        original = model.compute_logits

        def counting(hidden: torch.Tensor) -> torch.Tensor:
            rows.append(hidden.shape[0])
            return original(hidden)

        model.compute_logits = counting
        outputs = llm.generate([p[::-1] for p in prompts] + prompts, [embed] * 2 + [complete] * 2)
        assert [o.outputs[0].token_ids for o in outputs[2:]] == alone
        assert all(o.pooled is not None and len(o.outputs[0].token_ids) == 1 for o in outputs[:2])
        # Every row of logits belongs to a completion: 6 tokens each, plus guesses checked.
        assert sum(rows) >= 12
        if not speculative:
            assert sum(rows) == 12
        before = len(rows)
        llm.embed([prompts[1], prompts[0][::-1]])
        assert len(rows) == before  # a batch of embeddings alone computes no logits at all
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
