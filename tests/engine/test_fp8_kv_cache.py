"""An FP8 KV cache (--kv-cache-dtype fp8): keys and values stored as float8_e4m3fn.

The reference is transformers with an attention function of its own that rounds every key
and value through FP8 (clipped to +-448) before SDPA: what attention over an FP8 cache
computes, written apart from the engine's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine.kv_transfer.test_kv_transfer_engines import (
    all_free,
    core_request,
    decode_with,
    drive,
    engine_args,
    greedy,
    make_prompt,
    prefill_remotely,
)
from tests.engine.test_llm_vs_transformers import greedy_of, make_prompts
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.attention import get_attention_backend
from tidegate.engine.attention.backend import kv_cache_dtype, to_cache_dtype
from tidegate.engine.attention.cpu_attention import cpu_kernels_available
from tidegate.engine.core.engine_core import EngineCore

FP8 = torch.float8_e4m3fn
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
CPU = torch.device("cpu")


def through_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(FP8).to(x.dtype)


def transformers_fp8_kv_greedy(model_dir: Path, prompts) -> list[list[int]]:
    import sys

    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):
        # The model's own eager attention (SDPA's has no soft cap: Gemma 2's would be lost).
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, through_fp8(key), through_fp8(value), *args, **kwargs)

    AttentionInterface.register("tidegate_fp8_kv", fp8_kv_attention)
    # Eager's masks too: a custom attention without its own gets none (no sliding window).
    AttentionMaskInterface.register("tidegate_fp8_kv", eager_mask)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="tidegate_fp8_kv"
    )
    return greedy_of(model.eval(), prompts, MAX_TOKENS)


def prompts_for(model_dir: Path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return make_prompts(vocab)  # 1 to 330 tokens, three sharing a 100-token prefix


# --- units -----------------------------------------------------------------------------------


def test_values_are_clipped_to_fp8s_range_then_rounded():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.3, -7.84, 1e-4])
    stored = to_cache_dtype(x, FP8)
    assert stored.dtype == FP8
    assert stored.float().tolist() == [448, -448, 448, 0.3125, -8, 0]  # 1e-4: below 2 ** -9
    assert not stored.float().isnan().any()  # a plain cast makes 1000 NaN
    assert to_cache_dtype(x, torch.float32) is x
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="'int4' is not one of auto, fp8"):
        kv_cache_dtype("int4", torch.bfloat16)


def test_backends_that_read_an_fp8_cache(monkeypatch):
    shape = dict(head_dim=64, block_size=16, dtype=torch.float32, kv_cache_dtype=FP8)
    auto = get_attention_backend("auto", CPU, **shape)
    assert auto.name == ("cpu" if cpu_kernels_available() else "torch")
    assert get_attention_backend("torch", CPU, **shape).name == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or later"):
        get_attention_backend(
            "auto", torch.device("cuda"), dtype=torch.bfloat16, kv_cache_dtype=FP8
        )


# --- whole models ----------------------------------------------------------------------------


# Gemma 3: sliding-window layers, whose blocks before the window are skipped, and normed keys.
# Gemma 2: capped scores. The C++ kernel (the cpu backend, auto's pick on CPU) widens FP8 as it
# reads, the torch backend as it gathers.
@pytest.mark.parametrize(
    ("arch", "backend"),
    [("llama", "torch"), ("gemma3", "torch"), ("llama", "cpu"), ("gemma2", "cpu")],
)
def test_an_fp8_cache_gives_the_tokens_of_attention_over_fp8_keys_and_values(
    arch, backend, request
):
    """Chunked prompts (a 7-token cap) read their earlier chunks and cached prefixes back
    from the FP8 cache, as decodes do."""
    if backend == "cpu" and not cpu_kernels_available():
        pytest.skip("the CPU kernels need x86-64, a C++ compiler and ninja")
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = prompts_for(model_dir)
    with LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_dtype="fp8",
        attention_backend=backend,
        long_prefill_token_threshold=7,
        num_gpu_blocks=512,
    ) as llm:
        runner = llm.engine.executor.worker.runner
        assert runner.kv_caches[0][0].dtype == FP8 and runner.attn_backend.name == backend
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert got == transformers_fp8_kv_greedy(model_dir, prompts)


def test_an_fp8_cache_holds_four_times_the_blocks_of_a_float32_one(tiny_llama_dir):
    blocks = {}
    for dtype in ("auto", "fp8"):
        with LLM(
            str(tiny_llama_dir),
            dtype="float32",
            max_model_len=256,
            kv_cache_dtype=dtype,
            kv_cache_memory=8 << 20,
        ) as llm:
            blocks[dtype] = llm.stats()["num_total_blocks"]
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_prefill_and_decode_instances_move_fp8_blocks(tiny_llama_dir):
    """A producer and a consumer with FP8 caches give a unified FP8 engine's tokens, moving
    a quarter of a float32 cache's bytes; a consumer with another cache dtype refuses the
    blocks and computes the prompt itself."""
    fp8 = {"kv_cache_dtype": "fp8"}
    engines = {
        "unified": EngineCore(engine_args(tiny_llama_dir, **fp8)),
        "producer": EngineCore(engine_args(tiny_llama_dir, kv_role="producer", **fp8)),
        "consumer": EngineCore(engine_args(tiny_llama_dir, kv_role="consumer", **fp8)),
        "float32": EngineCore(engine_args(tiny_llama_dir, kv_role="consumer")),
    }
    try:
        prompt = make_prompt(250)
        expected = drive(engines["unified"], core_request("u", prompt, greedy(24)))["u"]["tokens"]
        consumer = engines["consumer"]
        received = consumer.stats()["kv_received_bytes"]
        params = prefill_remotely(engines["producer"], "p", prompt)
        assert decode_with(consumer, "c", prompt, params) == expected
        moved = consumer.stats()["kv_received_bytes"] - received
        layers, kv_heads, head_dim = 2, 2, 32  # the tiny Llama's
        # Keys and values of 16 blocks (250 tokens: 15 whole and a partial one), 1 byte each.
        assert moved == 2 * layers * 16 * 16 * kv_heads * head_dim
        assert consumer.stats()["kv_transfer_fallbacks"] == 0

        other = engines["float32"]
        params = prefill_remotely(engines["producer"], "p2", prompt)
        decode_with(other, "f", prompt, params)
        assert other.stats()["kv_transfer_fallbacks"] == 1
        assert all_free(consumer, other)
    finally:
        for engine in engines.values():
            engine.shutdown()
