"""An FP8 KV cache (--kv-cache-dtype fp8): keys and values stored as float8_e4m3fn.

The reference is transformers with an attention function of its own that rounds every key
and value through FP8 (clipped to +-448) before SDPA: what attention over an FP8 cache
computes, written apart from the engine's code.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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
from tidegate.engine.model.config import read_fp8_checkpoint
from tidegate.engine.model.quantization import KV_SCALE_NAME, kv_cache_scale, kv_cache_scales

FP8 = torch.float8_e4m3fn
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
CPU = torch.device("cpu")


# Per layer index, a calibrated (k_scale, v_scale): the cache holds k / k_scale, v / v_scale.
KVScales = dict[int, tuple[float, float]]


def through_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as an FP8 cache with this scale gives it back: x / scale, clipped, rounded, times scale."""
    return (x / scale).clamp(-448.0, 448.0).to(FP8).to(x.dtype) * scale


def eager_attention(module):
    """The model's own eager attention (SDPA's has no soft cap: Gemma 2's would be lost)."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def model_with_attention(model_dir: Path, name: str, attention):
    """transformers' model of the folder (float32) with `attention` as every layer's."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(name, attention)
    # Eager's masks too: a custom attention without its own gets none (no sliding window).
    AttentionMaskInterface.register(name, eager_mask)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=name
    )
    return model.eval()


def fp8_kv_reference(model_dir: Path, kv_scales: KVScales | None = None):
    """transformers attending over keys and values rounded through FP8 with these scales."""

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = (kv_scales or {}).get(module.layer_idx, (1.0, 1.0))
        key, value = through_fp8(key, k_scale), through_fp8(value, v_scale)
        return eager_attention(module)(module, query, key, value, *args, **kwargs)

    name = "tidegate_fp8_kv_scaled" if kv_scales else "tidegate_fp8_kv"
    return model_with_attention(model_dir, name, fp8_kv_attention)


def transformers_fp8_kv_greedy(model_dir: Path, prompts) -> list[list[int]]:
    return greedy_of(fp8_kv_reference(model_dir), prompts, MAX_TOKENS)


def chunked_fp8_llm(model_dir: Path, backend: str) -> LLM:
    """An FP8-cache engine on `backend` whose prompts run in 7-token chunks, so that they read
    their earlier chunks and cached prefixes back from the cache, as decodes do (skips the
    test where the cpu backend's kernels cannot be built)."""
    if backend == "cpu" and not cpu_kernels_available():
        pytest.skip("the CPU kernels need x86-64, a C++ compiler and ninja")
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_dtype="fp8",
        attention_backend=backend,
        long_prefill_token_threshold=7,
        num_gpu_blocks=512,
    )


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
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = prompts_for(model_dir)
    with chunked_fp8_llm(model_dir, backend) as llm:
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


# --- calibrated scales (a checkpoint's kv_cache_scheme) ---------------------------------------


def calibrate(model_dir: Path, prompts) -> KVScales:
    """What a calibration writes (llm-compressor's, per tensor): each layer's largest |k| and
    |v| over the prompts, over FP8's largest value."""
    amax: dict[int, tuple[float, float]] = {}

    def observe(module, query, key, value, *args, **kwargs):
        k_max, v_max = amax.get(module.layer_idx, (0.0, 0.0))
        k_max, v_max = max(k_max, key.abs().max().item()), max(v_max, value.abs().max().item())
        amax[module.layer_idx] = (k_max, v_max)
        return eager_attention(module)(module, query, key, value, *args, **kwargs)

    model = model_with_attention(model_dir, "tidegate_observe_kv", observe)
    with torch.inference_mode():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    # As a checkpoint stores them: float32.
    return {
        layer: tuple(torch.tensor([k, v]).div(448.0).tolist()) for layer, (k, v) in amax.items()
    }


def with_kv_scales(source: Path, folder: Path, kv_scales: KVScales) -> Path:
    """A copy of an unquantized checkpoint as llm-compressor writes one whose KV cache alone it
    quantized: a kv_cache_scheme, no config_groups, a k_scale and a v_scale per layer."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    for layer, (k_scale, v_scale) in kv_scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def prompt_logprobs_of(model, prompts) -> list[torch.Tensor]:
    """Per prompt, the log-probability of each of its tokens after the first."""
    with torch.inference_mode():
        rows = [torch.log_softmax(model(torch.tensor([p])).logits[0], dim=-1) for p in prompts]
    return [
        row[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        for row, p in zip(rows, prompts, strict=True)
    ]


@pytest.mark.parametrize(
    ("arch", "backend"), [("llama", "torch"), ("llama", "cpu"), ("gemma2", "cpu")]
)
def test_calibrated_scales_give_the_tokens_and_logprobs_of_attention_over_scaled_fp8(
    arch, backend, request, tmp_path
):
    """The cache holds k / k_scale and v / v_scale, read back through the same chunks, prefix
    hits and decodes as the unscaled test above, and the tokens and prompt logprobs are those
    of attention over FP8 keys and values with the calibrated scales; unscaled FP8 gives other
    logprobs, so the scales are what is tested."""
    source = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = prompts_for(source)
    kv_scales = calibrate(source, prompts)
    folder = with_kv_scales(source, tmp_path / "kv-scales", kv_scales)
    with chunked_fp8_llm(folder, backend) as llm:
        model = llm.engine.executor.worker.runner.model
        attention = [layer.self_attn for layer in model.model.layers]
        assert [a.kv_scales for a in attention] == [kv_scales[i] for i in range(len(attention))]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.stats()["prefix_cache_hits"] > 0
        params = dataclasses.replace(GREEDY, max_tokens=1, min_tokens=1, prompt_logprobs=0)
        outputs = llm.generate(prompts, params)
    scaled = fp8_kv_reference(source, kv_scales)
    assert got == greedy_of(scaled, prompts, MAX_TOKENS)
    want = prompt_logprobs_of(scaled, prompts)
    unscaled = prompt_logprobs_of(fp8_kv_reference(source), prompts)
    logprobs = torch.tensor(
        [
            output.prompt_logprobs[i][token].logprob
            for output, prompt in zip(outputs, prompts, strict=True)
            for i, token in enumerate(prompt)
            if i
        ]
    )
    # Equal but where a key or value lies so near the midpoint of two FP8 values that float32
    # rounding (the engine's products, transformers') sends it to the other one: such a flip
    # moves the later logprobs by up to a few hundredths. Measured on these models: a median
    # of 3e-6 and 1-3% of positions beyond 1e-3; against unscaled FP8, medians of 0.10-0.23.
    off = (logprobs - torch.cat(want)).abs()
    assert off.median() < 2e-5 and (off > 1e-3).float().mean() < 0.1, off
    assert (logprobs - torch.cat(unscaled)).abs().median() > 1e-2


def test_calibrated_scales_are_used_by_an_fp8_cache_only(tiny_llama_dir, tmp_path):
    """A 16- or 32-bit cache holds keys and values exactly as they are: the scales would only
    round them twice. So under --kv-cache-dtype auto the tokens are the unscaled checkpoint's."""
    prompts = prompts_for(tiny_llama_dir)[:3]
    folder = with_kv_scales(tiny_llama_dir, tmp_path / "kv-scales", {0: (0.02, 0.03)})
    results = []
    for model_dir in (folder, tiny_llama_dir):
        with LLM(str(model_dir), dtype="float32", max_model_len=512) as llm:
            model = llm.engine.executor.worker.runner.model
            assert all(layer.self_attn.kv_scales is None for layer in model.model.layers)
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
    assert results[0] == results[1]


def test_kv_scale_names_and_values():
    names = {
        "model.layers.3.self_attn.k_scale": ("model.layers.3.self_attn", "k"),  # llm-compressor
        "model.layers.3.self_attn.v_scale": ("model.layers.3.self_attn", "v"),
        "model.layers.3.self_attn.kv_scale": ("model.layers.3.self_attn", "kv"),  # AutoFP8
        "model.layers.3.self_attn.k_proj.k_scale": ("model.layers.3.self_attn", "k"),  # ModelOpt
        "model.layers.3.self_attn.v_proj.v_scale": ("model.layers.3.self_attn", "v"),
        "model.layers.3.self_attn.k_proj.weight_scale": None,
        "model.layers.3.self_attn.k_proj.input_scale": None,
        "model.layers.3.mlp.down_proj.k_scale": None,
    }
    for name, expected in names.items():
        match = KV_SCALE_NAME.match(name)
        assert (match and (match["attention"], match["kind"])) == expected, name
    assert kv_cache_scales(
        {"a": {"k": 0.5, "v": 0.25, "kv": 8.0}, "b": {"kv": 0.125}, "c": {"k": 2.0}}
    ) == {"a": (0.5, 0.25), "b": (0.125, 0.125), "c": (2.0, 1.0)}
    assert kv_cache_scale("s", torch.tensor([0.5])) == 0.5
    with pytest.raises(ValueError, match=r"holds 4 KV-cache scales \(shape \(4,\)\)"):
        kv_cache_scale("model.layers.0.self_attn.k_scale", torch.ones(4))  # one per head
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be positive and finite"):
            kv_cache_scale("s", torch.tensor(bad))


def test_kv_cache_schemes():
    kv_only = {
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
    assert read_fp8_checkpoint(kv_only) is None  # the weights are unquantized
    assert read_fp8_checkpoint({**kv_only, "config_groups": {}}) is None
    int8 = {**kv_only, "kv_cache_scheme": {"num_bits": 8, "type": "int"}}
    with pytest.raises(ValueError, match="only 8-bit float"):
        read_fp8_checkpoint(int8)
    per_head = {
        **kv_only,
        "kv_cache_scheme": {**kv_only["kv_cache_scheme"], "strategy": "attn_head"},
    }
    with pytest.raises(ValueError, match="strategy 'attn_head' is not supported"):
        read_fp8_checkpoint(per_head)
    auto_fp8 = {"quant_method": "fp8", "activation_scheme": "static", "kv_cache_scheme": "static"}
    assert read_fp8_checkpoint(auto_fp8) is not None


@pytest.mark.slow
def test_compiled_scaled_attention_gives_the_eager_tokens(tiny_llama_dir, tmp_path):
    """Inductor takes the scales in as constants of the graph (the compiled layer op on the cpu
    backend, where the kernels build)."""
    prompts = prompts_for(tiny_llama_dir)[:4]
    folder = with_kv_scales(
        tiny_llama_dir, tmp_path / "kv-scales", calibrate(tiny_llama_dir, prompts)
    )
    tokens = []
    for level in (0, 1):
        with LLM(
            str(folder),
            dtype="float32",
            max_model_len=512,
            kv_cache_dtype="fp8",
            compilation_level=level,
        ) as llm:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
    assert tokens[0] == tokens[1]
