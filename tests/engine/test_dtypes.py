"""--dtype auto: the checkpoint's dtype, except float32 on a CPU that would emulate it."""

from __future__ import annotations

import json
import platform
import shutil

import pytest

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.config import EngineArgs
from tidegate.engine.model import dtypes
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.model.dtypes import auto_dtype, with_auto_dtype

ICE_LAKE = frozenset({"sse2", "avx2", "avx512f", "avx512_vnni"})
SAPPHIRE_RAPIDS = ICE_LAKE | {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
GIB = 1 << 30


def test_a_cpu_without_bf16_dot_products_runs_a_bf16_checkpoint_in_float32():
    dtype, why = auto_dtype("bfloat16", "cpu", GIB, GIB, ICE_LAKE, 64 * GIB)
    assert dtype == "float32"
    assert "this CPU has no AVX512_BF16 or AMX_BF16" in why and "--dtype" in why
    dtype, why = auto_dtype("float16", "cpu", GIB, GIB, ICE_LAKE, 64 * GIB)
    assert dtype == "float32" and "AVX512_FP16 or AMX_FP16" in why


@pytest.mark.parametrize(
    ("checkpoint", "device", "flags"),
    [
        ("bfloat16", "cpu", SAPPHIRE_RAPIDS),  # native
        ("bfloat16", "cpu", ICE_LAKE | {"amx_bf16"}),  # either flag will do
        ("float16", "cpu", SAPPHIRE_RAPIDS),
        ("bfloat16", "cuda", ICE_LAKE),  # GPUs compute 16-bit natively
        ("bfloat16", "cpu", frozenset()),  # not x86 (or no /proc/cpuinfo): not judged
        ("float32", "cpu", ICE_LAKE),
    ],
)
def test_the_checkpoints_dtype_where_it_runs_natively(checkpoint, device, flags):
    assert auto_dtype(checkpoint, device, GIB, GIB, flags, 64 * GIB) == (checkpoint, None)


def test_no_dtype_in_the_config_is_float32():
    assert auto_dtype(None, "cpu", GIB, GIB, ICE_LAKE, 64 * GIB) == ("float32", None)


def test_float32_only_where_twice_the_weights_and_the_cache_fit(monkeypatch):
    # 2 x 6 GiB of weights + 2 GiB of cache = 14 GiB: above 60% of 20 GiB, within 60% of 24.
    dtype, why = auto_dtype("bfloat16", "cpu", 6 * GIB, 2 * GIB, ICE_LAKE, 20 * GIB)
    assert dtype == "bfloat16"
    assert "(14.0 GiB) do not fit in 60% of the 20.0 GiB available" in why
    assert auto_dtype("bfloat16", "cpu", 6 * GIB, 2 * GIB, ICE_LAKE, 24 * GIB)[0] == "float32"
    # Memory that cannot be read does not stop the upcast.
    monkeypatch.setattr(dtypes, "available_memory_bytes", lambda: None)
    assert auto_dtype("bfloat16", "cpu", 6 * GIB, 2 * GIB, ICE_LAKE)[0] == "float32"


def test_this_machines_flags_and_memory_are_read():
    flags = dtypes.cpu_x86_flags()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "sse2" in flags
    else:
        assert flags == frozenset()
    memory = dtypes.available_memory_bytes()
    assert memory is not None and memory > 0
    import torch

    from tidegate.engine.device import runs_on_cpu

    assert runs_on_cpu("cpu") and not runs_on_cpu("cuda")
    assert runs_on_cpu("auto") == (torch.cuda.device_count() == 0)


@pytest.fixture
def bf16_config_dir(tiny_llama_dir, tmp_path):
    """The tiny Llama with config.json saying bfloat16 (its weights stay float32 on disk,
    which the loader converts as it would any checkpoint)."""
    folder = tmp_path / "bf16"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_engine_runs_what_auto_picked_and_an_explicit_dtype_as_given(
    bf16_config_dir, monkeypatch
):
    monkeypatch.setattr(dtypes, "cpu_x86_flags", lambda: ICE_LAKE)
    config = ModelConfig.from_pretrained(bf16_config_dir)
    args = EngineArgs(model=str(bf16_config_dir), device="cpu")
    assert with_auto_dtype(args, config).dtype == "float32"
    given = args.model_copy(update={"dtype": "bfloat16"})
    assert with_auto_dtype(given, config) is given
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [[1, 5, 6, 7, 8], [1, *range(40, 70)]]
    with LLM(str(bf16_config_dir), device="cpu", max_model_len=256) as llm:
        assert llm.engine.args.dtype == "float32"
        assert str(llm.engine.executor.worker.runner.dtype) == "torch.float32"
        auto = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(bf16_config_dir), dtype="float32", max_model_len=256) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == auto
    monkeypatch.setattr(dtypes, "cpu_x86_flags", lambda: SAPPHIRE_RAPIDS)
    with LLM(str(bf16_config_dir), device="cpu", max_model_len=256) as llm:
        assert str(llm.engine.executor.worker.runner.dtype) == "torch.bfloat16"


def test_an_fp8_checkpoint_is_judged_by_the_size_it_loads_at(tiny_fp8_model, monkeypatch, tmp_path):
    """Multiplied out at load (auto on CPU), an FP8 checkpoint takes twice its files' bytes
    as 16-bit weights; held in FP8 (--quantization fp8), its files' bytes."""
    folder = tmp_path / "fp8-bf16"
    shutil.copytree(tiny_fp8_model("llama", "fp8-block"), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["torch_dtype"] = "bfloat16"  # what FP8 checkpoints' activations are
    (folder / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(folder)
    seen = []
    monkeypatch.setattr(
        dtypes,
        "auto_dtype",
        lambda _dtype, _device, weights, _kv: seen.append(weights) or ("float32", None),
    )
    stored = dtypes.checkpoint_bytes(folder)
    for quantization in ("auto", "none", "fp8"):
        with_auto_dtype(
            EngineArgs(model=str(folder), device="cpu", quantization=quantization), config
        )
    assert seen == [2 * stored, 2 * stored, stored]
