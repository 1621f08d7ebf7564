"""Checkpoints split into several safetensors shards, stored in another dtype, still load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.model.layers import MergedLinear


def write_sharded_copy(src, dst, num_shards: int, dtype: torch.dtype | None) -> None:
    """Copy a model folder with its weights split across shards (and an index file)."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        if dtype is not None:
            part = {n: t.to(dtype) for n, t in part.items()}
        save_file(part, dst / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def greedy(model_dir, prompts, logprobs=None):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


PROMPTS = [[1, 40, 41, 42, 43], [1, *range(100, 160)]]


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_three_shards_give_the_same_tokens_as_one_file(request, tmp_path, arch_fixture):
    src = request.getfixturevalue(arch_fixture)
    write_sharded_copy(src, tmp_path / "sharded", num_shards=3, dtype=None)
    expected = [c.token_ids for c in greedy(src, PROMPTS)]
    assert [c.token_ids for c in greedy(tmp_path / "sharded", PROMPTS)] == expected


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_into_float32(tiny_llama_dir, tmp_path, stored):
    write_sharded_copy(tiny_llama_dir, tmp_path / "half", num_shards=2, dtype=stored)
    full = greedy(tiny_llama_dir, PROMPTS, logprobs=5)
    half = greedy(tmp_path / "half", PROMPTS, logprobs=5)
    for a, b in zip(full, half, strict=True):
        # Rounded weights move logits a little: the first step's top-5 mostly agree.
        assert len(set(a.logprobs[0]) & set(b.logprobs[0])) >= 4


def test_a_fused_tensor_of_the_wrong_size_is_refused():
    """Phi-3's qkv_proj fills q, k and v of a merged linear; a tensor of other rows does not
    fit, whatever its slices would hold."""
    merged = MergedLinear(16, {"gate": 8, "up": 8})
    with torch.no_grad():
        merged.weight_loader(merged.weight, torch.arange(256.0).view(16, 16))
        assert torch.equal(merged.weight, torch.arange(256.0).view(16, 16))
        with pytest.raises(ValueError, match="of 20 rows cannot hold this linear's gate 8, up 8"):
            merged.weight_loader(merged.weight, torch.zeros(20, 16))
