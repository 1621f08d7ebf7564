"""The whole engine with the Triton attention backend (interpreted on CPU) equals torch's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from tidegate.engine import LLM, SamplingParams


# Gemma 3: a 24-token sliding-window layer beside a full one, in the kernel's SLIDING path;
# Gemma 2 also caps its scores (SOFT_CAP).
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_greedy_output_is_token_identical_to_the_torch_backend(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    shared = "The tide gate opens at dawn and closes at dusk, every day of the year, " * 2
    prompts = [
        shared + "while the keeper sleeps",  # long: prefilled in chunks
        shared + "and the boats wait",  # the same prefix: cached blocks, context > 0
        "Hi",
        [5, 17, 99, 3, 250, 61, 7],
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    # A small step budget: prompts are chunked and decodes share steps with prefill chunks.
    common = dict(dtype="float32", max_num_batched_tokens=40, long_prefill_token_threshold=24)
    reference = LLM(model=str(model_dir), attention_backend="torch", **common)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    triton_llm = LLM(model=str(model_dir), attention_backend="triton", **common)
    assert triton_llm.engine.executor.worker.runner.attn_backend.name == "triton"
    got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)]
    assert got == expected
    assert triton_llm.stats()["prefix_cache_hits"] > 0


def test_fp8_products_in_triton_give_the_tokens_of_torchs(tiny_fp8_model):
    """The FP8 linears' Triton kernel (fp8_triton.py) runs with the triton backend: the same
    tokens as torch's scaled products, for 32 x 32 blocks and for per-channel scales, and in a
    mixture's experts."""
    prompts = ["The tide gate opens at dawn", [5, 17, 99, 3, 250, 61, 7]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for arch, quantize in [
        ("llama", "fp8-block"),
        ("llama", "fp8-channel"),
        ("qwen3_moe", "fp8-block"),
    ]:
        folder = str(tiny_fp8_model(arch, quantize))
        common = dict(dtype="float32", quantization="fp8", max_model_len=256)
        reference = LLM(model=folder, attention_backend="torch", **common)
        expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
        triton_llm = LLM(model=folder, attention_backend="triton", **common)
        qkv = triton_llm.engine.executor.worker.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.triton and qkv.weight_scale is not None
        got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)]
        assert got == expected


def test_an_fp8_kv_cache_in_triton_gives_the_tokens_of_torchs(tiny_gemma3_dir):
    """--kv-cache-dtype fp8 with the triton backend: the tokens of the torch backend's FP8
    cache (Gemma 3: a windowed layer beside a full one), prompts chunked and prefix-cached."""
    shared = "The tide gate opens at dawn and closes at dusk, every day of the year, " * 2
    prompts = [shared + "while the keeper sleeps", shared + "and the boats wait", "Hi"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    common = dict(
        dtype="float32",
        kv_cache_dtype="fp8",
        max_num_batched_tokens=40,
        long_prefill_token_threshold=24,
    )
    reference = LLM(model=str(tiny_gemma3_dir), attention_backend="torch", **common)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    triton_llm = LLM(model=str(tiny_gemma3_dir), attention_backend="triton", **common)
    assert triton_llm.engine.executor.worker.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)]
    assert got == expected
    assert triton_llm.stats()["prefix_cache_hits"] > 0
