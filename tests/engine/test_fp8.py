"""FP8 weights: checkpoints in the three layouts, and 16/32-bit checkpoints quantized at load.

Two references, both written here apart from the engine's code:
- dequantized: the checkpoint's weights multiplied out by their scales into a plain folder,
  run by transformers. The engine's `dequantize` format (what auto picks on CPU) must give
  its greedy tokens, and transformers' own FP8 reader (quant_method fp8) must agree.
- W8A8: the same transformers model, with each decoder linear's input quantized to FP8 per
  token (and K-group) and back before the product, which is what FP8 products compute.
  The engine's `fp8` format must give its greedy tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.test_llm_vs_transformers import greedy_of, make_prompts
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.distributed import parallel_state
from tidegate.engine.model.config import Fp8Checkpoint, ModelConfig, read_fp8_checkpoint
from tidegate.engine.model.layers import (
    Fp8Layout,
    Linear,
    MergedLinear,
    RowParallelLinear,
    fp8_linears,
)
from tidegate.engine.model.moe import FusedExperts, SparseMoE
from tidegate.engine.model.quantization import (
    FP8_DTYPE,
    DequantizedSlice,
    fp8_matmuls_native,
    resolve_weight_format,
)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
CPU = torch.device("cpu")
BLOCK = Fp8Checkpoint("fp8", (32, 32))


# --- references ------------------------------------------------------------------------------


def dequantized_copy(src: Path, dst: Path) -> int | None:
    """Write src's FP8 checkpoint multiplied out into a plain folder; returns the activation
    K-group of its products (the block's width), None for one group per row."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    quantization = config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    block = quantization.get("weight_block_size")
    strategy = None
    if "config_groups" in quantization:
        strategy = quantization["config_groups"]["group_0"]["weights"]["strategy"]
    tensors = load_file(src / "model.safetensors")
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if tensor.dtype == FP8_DTYPE:
            prefix = name.removesuffix(".weight")
            scale = tensors.get(prefix + ".weight_scale_inv", tensors.get(prefix + ".weight_scale"))
            if block is not None:
                rows, cols = tensor.shape
                scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
                scale = scale[:rows, :cols]
            elif strategy == "channel":
                assert scale.shape == (tensor.shape[0], 1)
            else:
                assert scale.numel() == 1
            tensor = tensor.float() * scale.float()
        plain[name] = tensor
    (dst / "model.safetensors").unlink()
    save_file(plain, dst / "model.safetensors", metadata={"format": "pt"})
    return block[1] if block is not None else None


def through_fp8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x quantized to FP8 per row and K-group of `group` columns (None: the whole row), and
    back to float32."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    width = x.shape[1]
    group = group or width
    groups = -(-width // group)
    padded = torch.nn.functional.pad(x, (0, groups * group - width)).view(-1, groups, group)
    scale = padded.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 448.0
    rounded = (padded / scale).clamp(-448.0, 448.0).to(FP8_DTYPE).float() * scale
    return rounded.view(-1, groups * group)[:, :width].reshape(shape)


def _through_fp8_linears(forward, group: int | None, quantize_weights: bool):
    """`forward` with every F.linear it calls taking its input (and weight) through FP8."""
    linear = torch.nn.functional.linear

    def fp8_linear(x, weight, bias=None):
        weight = through_fp8(weight, None) if quantize_weights else weight
        return linear(through_fp8(x, group), weight, bias)

    def patched(*args, **kwargs):
        with mock.patch.object(torch.nn.functional, "linear", fp8_linear):
            return forward(*args, **kwargs)

    return patched


def transformers_greedy(
    model_dir: Path,
    prompts,
    w8a8: bool = False,
    group: int | None = None,
    quantize_weights: bool = False,
    skip: tuple[str, ...] = (),
    adapter: Path | None = None,
):
    """transformers' greedy tokens. w8a8: each decoder linear's input (and each expert's) goes
    through FP8 first (per token and K-group of `group` columns; a mixture's router and the
    linears whose names end with one of `skip` excepted); quantize_weights: their weights too,
    per row, as a 16/32-bit checkpoint is quantized at load. adapter: a LoRA adapter applied
    by PEFT, whose deltas see the linears' inputs as they are."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, module in model.named_modules() if w8a8 else ():
        if type(module).__name__.endswith("Experts"):  # [E, out, in] weights, F.linear each
            # The loop over experts (not a grouped product, which calls no F.linear).
            module.config._experts_implementation = "eager"
            module.forward = _through_fp8_linears(module.forward, group, quantize_weights)
            continue
        if not isinstance(module, torch.nn.Linear) or ".layers." not in name:
            continue
        if name.endswith(".gate") or name.endswith(skip):
            continue
        if quantize_weights:
            module.weight.data = through_fp8(module.weight.data, None)
        module.register_forward_pre_hook(lambda _module, args: (through_fp8(args[0], group),))
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter))
    return greedy_of(model, prompts, MAX_TOKENS)


def engine_greedy(model_dir: Path, prompts, **kwargs):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512, **kwargs)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def prompts_for(model_dir: Path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return make_prompts(vocab)[:5]  # 1 to 330 tokens, two sharing a prefix


def fp8_linears_of(llm: LLM) -> list[Linear]:
    model = llm.engine.executor.worker.runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and m.weight_scale is not None]


# --- config.json -----------------------------------------------------------------------------


def _compressed(weights: dict, activations: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights}
    if activations is not None:
        group["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}


FLOAT8 = {"num_bits": 8, "type": "float"}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, None),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, ("fp8", (128, 128))),
        ({"quant_method": "fp8", "activation_scheme": "static"}, ("fp8", None)),
        ({"quant_method": "fbgemm_fp8"}, ("fbgemm_fp8", None)),
        (_compressed({**FLOAT8, "strategy": "channel"}), ("compressed-tensors", None)),
        (
            _compressed({**FLOAT8, "strategy": "tensor"}, {**FLOAT8, "dynamic": False}),
            ("compressed-tensors", None),
        ),
        (
            _compressed({**FLOAT8, "strategy": "block", "block_structure": [128, 64]}),
            ("compressed-tensors", (128, 64)),
        ),
    ],
)
def test_reads_the_fp8_layouts(config, expected):
    got = read_fp8_checkpoint(config)
    assert (got.method, got.block) == expected if expected else got is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq' .* not supported; supported: FP8"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq' .* not supported"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' .* not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "not two positive integers"),
        (
            _compressed({"num_bits": 4, "type": "int", "strategy": "group"}),
            "4-bit int; supported: FP8",
        ),
        (
            _compressed({**FLOAT8, "strategy": "channel"}, {"num_bits": 8, "type": "int"}),
            "activations to 8-bit int",
        ),
        (_compressed({**FLOAT8, "strategy": "group"}), "strategy 'group' is not supported"),
        ({"quant_method": "compressed-tensors"}, "has no config_groups"),
    ],
)
def test_refuses_other_quantizations_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        read_fp8_checkpoint(config)


def test_a_folder_with_an_unsupported_quantization_is_refused_before_loading(
    tiny_llama_dir, tmp_path
):
    folder = tmp_path / "awq"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'awq' .* not supported"):
        ModelConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"'awq' .* not supported"):
        LLM(model=str(folder), dtype="float32", max_model_len=256)


def test_how_weights_are_held_for_each_choice_and_device(monkeypatch):
    assert resolve_weight_format("auto", None, CPU) is None
    assert resolve_weight_format("auto", BLOCK, CPU) == "dequantize"
    assert resolve_weight_format("none", BLOCK, CPU) == "dequantize"
    assert resolve_weight_format("none", None, CPU) is None
    assert resolve_weight_format("fp8", None, CPU) == "fp8"  # quantized at load
    assert resolve_weight_format("fp8", BLOCK, CPU) == "fp8"
    # GPUs: FP8 products from compute capability 8.9 (Ada, Hopper) on.
    cuda = torch.device("cuda")
    for capability, native in [((8, 0), False), ((8, 9), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        assert fp8_matmuls_native(cuda) is native
        assert resolve_weight_format("auto", BLOCK, cuda) == ("fp8" if native else "dequantize")
        assert resolve_weight_format("auto", None, cuda) is None


# --- layers ----------------------------------------------------------------------------------


def _block_quantized(rows: int, cols: int, block: tuple[int, int], seed: int):
    """(FP8 weight, block scale, the float32 weight they stand for)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator)
    scale = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=generator) + 0.01
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    fp8 = (weight / full).clamp(-448, 448).to(FP8_DTYPE)
    return fp8, scale, fp8.float() * full


def _dequantized(linear: Linear) -> torch.Tensor:
    scale = linear.weight_scale.repeat_interleave(linear.scale_group, dim=1)
    return linear.weight.float() * scale[:, : linear.weight.shape[1]]


@pytest.fixture
def two_ranks(monkeypatch):
    """Set this process's tensor-parallel rank (of two), as a worker's would be."""

    def be(rank: int) -> None:
        monkeypatch.setattr(parallel_state, "_state", parallel_state._Ranks(rank, 2, 1))

    return be


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_rows_and_columns_of_block_scaled_weights(two_ranks, rank):
    """Column-parallel shards (gate/up) and row-parallel columns (down) of 32 x 32 blocks,
    with rows that end inside a block (72 = 2 x 32 + 8): each rank's weights, multiplied
    out, are its slices of the whole."""
    two_ranks(rank)
    layout = Fp8Layout(BLOCK, triton=False)
    gate, gate_scale, gate_full = _block_quantized(144, 64, BLOCK.block, seed=1)
    up, up_scale, up_full = _block_quantized(144, 64, BLOCK.block, seed=2)
    down, down_scale, down_full = _block_quantized(72, 128, BLOCK.block, seed=3)
    with fp8_linears(layout):
        merged = MergedLinear(64, {"gate": 144, "up": 144})
        row = RowParallelLinear(128, 72)
    with torch.no_grad():
        for shard, weight, scale in [("gate", gate, gate_scale), ("up", up, up_scale)]:
            merged.weight_loader(merged.weight, weight, shard)
            merged.weight.scale_loader(scale, BLOCK, shard)
        row.weight_loader(row.weight, down, None)
        row.weight.scale_loader(down_scale, BLOCK, None)
    rows = slice(72 * rank, 72 * (rank + 1))
    assert merged.weight.dtype == FP8_DTYPE
    assert torch.equal(_dequantized(merged), torch.cat([gate_full[rows], up_full[rows]]))
    assert row.weight_scale.shape == (72, 2)  # 64 columns: two 32-wide groups
    assert torch.equal(_dequantized(row), down_full[:, 64 * rank : 64 * (rank + 1)])


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_share_of_every_experts_block_scaled_weights(two_ranks, rank):
    two_ranks(rank)
    with fp8_linears(Fp8Layout(BLOCK, triton=False)):
        experts = FusedExperts(num_experts=2, hidden_size=48, intermediate_size=128)
    full = {}
    with torch.no_grad():
        for e in range(2):
            for seed, (kind, shape) in enumerate(
                [("gate", (128, 48)), ("up", (128, 48)), ("down", (48, 128))]
            ):
                weight, scale, full[kind, e] = _block_quantized(
                    *shape, BLOCK.block, seed=10 * e + seed
                )
                param = experts.down_proj if kind == "down" else experts.gate_up_proj
                param.weight_loader(param, weight, f"{kind}.{e}")
                param.scale_loader(scale, BLOCK, f"{kind}.{e}")
    rows = slice(64 * rank, 64 * (rank + 1))
    for e in range(2):
        gate_up = (
            experts.gate_up_proj[e].float()
            * experts.gate_up_scale[e].repeat_interleave(32, dim=1)[:, :48]
        )
        down = experts.down_proj[e].float() * experts.down_scale[e].repeat_interleave(32, dim=1)
        assert torch.equal(gate_up, torch.cat([full["gate", e][rows], full["up", e][rows]]))
        assert torch.equal(down, full["down", e][:, rows])


def test_a_scale_that_does_not_fit_its_weight_is_refused_by_shape():
    weight = torch.randn(70, 64).to(FP8_DTYPE)
    with pytest.raises(
        ValueError, match=r"shape \(70, 64\) has a scale of shape \(2, 2\).* needs \(3, 2\)"
    ):
        DequantizedSlice(weight, torch.ones(2, 2), BLOCK)
    with pytest.raises(ValueError, match=r"scale of shape \(64, 1\).* needs \(70, 1\)"):
        DequantizedSlice(weight, torch.ones(64, 1), Fp8Checkpoint("fbgemm_fp8", None))
    with fp8_linears(Fp8Layout(BLOCK, triton=False)):
        linear = Linear(64, 70)
    with pytest.raises(ValueError, match=r"weight scale of shape \(3, 1\) does not fit"):
        linear.weight.scale_loader(torch.ones(3, 1), BLOCK)


def test_per_tensor_scales_of_merged_shards_become_their_rows(two_ranks):
    two_ranks(1)
    checkpoint = Fp8Checkpoint("compressed-tensors", None)
    with fp8_linears(Fp8Layout(checkpoint, triton=False)):
        merged = MergedLinear(16, {"gate": 8, "up": 8})
    weight = torch.ones(8, 16).to(FP8_DTYPE)
    with torch.no_grad():
        for shard, scale in [("gate", 0.5), ("up", 2.0)]:
            merged.weight_loader(merged.weight, weight, shard)
            merged.weight.scale_loader(torch.tensor([scale]), checkpoint, shard)
    assert merged.weight_scale.flatten().tolist() == [0.5] * 4 + [2.0] * 4


def test_a_split_inside_a_scale_block_is_refused(two_ranks):
    two_ranks(1)
    with (
        fp8_linears(Fp8Layout(Fp8Checkpoint("fp8", (128, 128)), triton=False)),
        pytest.raises(ValueError, match="at 192, inside one of its 128-column FP8 scale blocks"),
    ):
        RowParallelLinear(384, 128)


@pytest.mark.parametrize(
    ("checkpoint", "scale"),
    [
        (BLOCK, torch.rand(3, 2) + 0.1),  # [ceil(70 / 32), ceil(64 / 32)]
        (Fp8Checkpoint("compressed-tensors", None), torch.rand(70, 1) + 0.1),
        (Fp8Checkpoint("compressed-tensors", None), torch.tensor([0.3])),
    ],
    ids=["block", "channel", "tensor"],
)
def test_a_dequantized_slice_is_the_slice_of_the_dequantized_weight(checkpoint, scale):
    weight = torch.randn(70, 64).to(FP8_DTYPE)
    if checkpoint.block:
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[:70]
    else:
        full = scale.reshape(-1, 1) if scale.numel() > 1 else scale
    whole = weight.float() * full
    lazy = DequantizedSlice(weight, scale, checkpoint)
    assert lazy.get_shape() == [70, 64]
    assert torch.equal(lazy[:], whole)
    assert torch.equal(lazy[33:61], whole[33:61])
    assert torch.equal(lazy[:, 20:50], whole[:, 20:50])


def test_a_linear_quantized_at_load_computes_w8a8():
    """Per-row weight scales, per-token activation scales: the product of both roundings."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=generator)
    x = torch.randn(5, 96, generator=generator) * 3
    with fp8_linears(Fp8Layout(None, triton=False)):
        linear = Linear(96, 48)
    with torch.no_grad():
        linear.weight_loader(linear.weight, weight)
    assert linear.weight.dtype == FP8_DTYPE and linear.weight_scale.shape == (48, 1)
    expected = through_fp8(x, None) @ through_fp8(weight, None).T
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


# --- whole models ----------------------------------------------------------------------------

# Qwen3-MoE: every expert's projections quantized (FP8 products expert by expert), its router
# not.
CHECKPOINTS = [
    ("llama", "fp8-block"),
    ("llama", "fp8-channel"),
    ("llama", "fp8-tensor"),
    ("qwen3_moe", "fp8-block"),
    ("gemma3", "fp8-channel"),
    ("phi3", "fp8-block"),  # fused qkv_proj and gate_up_proj, and their scales
]
IDS = [f"{arch}-{quantize}" for arch, quantize in CHECKPOINTS]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=IDS)
def checkpoint(request, tiny_fp8_model, tmp_path_factory):
    """(FP8 folder, its dequantized copy, the K-group of its activations, prompts)."""
    arch, quantize = request.param
    folder = tiny_fp8_model(arch, quantize)
    plain = tmp_path_factory.mktemp(f"dequantized-{arch}-{quantize}") / "model"
    group = dequantized_copy(folder, plain)
    return folder, plain, group, prompts_for(folder)


def test_a_dequantized_checkpoint_gives_the_tokens_of_its_multiplied_out_weights(checkpoint):
    folder, plain, _, prompts = checkpoint
    llm, got = engine_greedy(folder, prompts)  # auto on CPU: dequantized at load
    assert not fp8_linears_of(llm)
    assert got == transformers_greedy(plain, prompts)
    if (
        json.loads((folder / "config.json").read_text())["quantization_config"].get("quant_method")
        == "fp8"
    ):
        # transformers reads the FP8 folder itself too (and dequantizes it on CPU).
        assert got == transformers_greedy(folder, prompts)


def test_fp8_weights_give_the_tokens_of_fp8_products(checkpoint):
    folder, plain, group, prompts = checkpoint
    llm, got = engine_greedy(folder, prompts, quantization="fp8")
    linears = fp8_linears_of(llm)
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert got == transformers_greedy(plain, prompts, w8a8=True, group=group)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_16_bit_checkpoint_quantized_at_load_gives_the_tokens_of_fp8_products(arch, request):
    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = prompts_for(folder)
    llm, got = engine_greedy(folder, prompts, quantization="fp8")
    linears = fp8_linears_of(llm)
    model = llm.engine.executor.worker.runner.model
    # Every attention and dense MLP projection, and the experts; routers stay float32.
    assert len(linears) == sum(
        isinstance(m, Linear) for n, m in model.named_modules() if not n.endswith(".gate")
    )
    assert all(m.weight.element_size() == 1 for m in linears)
    for module in model.modules():
        if isinstance(module, FusedExperts):
            assert module.gate_up_proj.dtype == module.down_proj.dtype == FP8_DTYPE
        if isinstance(module, SparseMoE):
            assert module.gate.weight.dtype == torch.float32
    assert got == transformers_greedy(folder, prompts, w8a8=True, quantize_weights=True)


def test_compiled_fp8_products_give_the_eager_tokens(tiny_fp8_model):
    folder = tiny_fp8_model("llama", "fp8-block")
    prompts = prompts_for(folder)[:3]
    _, eager = engine_greedy(folder, prompts, quantization="fp8")
    _, compiled = engine_greedy(folder, prompts, quantization="fp8", compilation_level=1)
    assert compiled == eager


def test_scales_stored_in_other_files_than_their_weights(tiny_fp8_model, tmp_path):
    from tests.engine.test_loader_shards import write_sharded_copy

    folder = tiny_fp8_model("llama", "fp8-block")
    sharded = tmp_path / "sharded"
    write_sharded_copy(folder, sharded, num_shards=3, dtype=None)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert index[name] != index[name + "_scale_inv"]
    prompts = prompts_for(folder)[:3]
    for quantization in ("auto", "fp8"):
        assert (
            engine_greedy(sharded, prompts, quantization=quantization)[1]
            == engine_greedy(folder, prompts, quantization=quantization)[1]
        )


def test_a_quantized_config_without_scales_is_refused(tiny_llama_dir, tmp_path):
    folder = tmp_path / "no-scales"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"says the checkpoint is quantized .* no weight .* scale"):
        LLM(model=str(folder), dtype="float32", max_model_len=256)


def test_modules_the_checkpoint_left_unquantized_keep_their_dtype(tiny_fp8_model, tmp_path):
    """An ignore list's module has no scale: it is held, and computes, as the checkpoint
    stores it."""
    source = tiny_fp8_model("llama", "fp8-channel")
    plain = tmp_path / "plain"
    dequantized_copy(source, plain)
    folder = tmp_path / "partly"
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    full = load_file(plain / "model.safetensors")
    for proj in ("q_proj", "k_proj", "v_proj"):  # layer 1's attention: all three shards
        name = f"model.layers.1.self_attn.{proj}.weight"
        tensors[name] = full[name]
        del tensors[name + "_scale"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    prompts = prompts_for(folder)[:3]
    llm, got = engine_greedy(folder, prompts, quantization="fp8")
    model = llm.engine.executor.worker.runner.model
    kept = model.model.layers[1].self_attn.qkv_proj
    assert kept.weight.dtype == torch.float32 and kept.weight_scale is None
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    skip = tuple(f"layers.1.self_attn.{proj}" for proj in ("q_proj", "k_proj", "v_proj"))
    assert got == transformers_greedy(plain, prompts, w8a8=True, skip=skip)


def test_adapters_over_fp8_weights_equal_peft_over_fp8_products(tiny_fp8_model, tmp_path):
    """A LoRA delta is computed from the linear's input as it is, in the model's dtype, and
    added to the FP8 product."""
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    folder = tiny_fp8_model("llama", "fp8-block")
    plain = tmp_path / "plain"
    group = dequantized_copy(folder, plain)
    adapter = make_tiny_adapter(plain, tmp_path / "adapter", rank=8, seed=1)
    prompts = prompts_for(folder)[:3]
    with LLM(
        str(folder), dtype="float32", max_model_len=512, quantization="fp8", enable_lora=True
    ) as llm:
        lora = llm.load_lora("a", str(adapter))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == transformers_greedy(plain, prompts, w8a8=True, group=group, adapter=adapter)
    assert base == transformers_greedy(plain, prompts, w8a8=True, group=group)
    assert got != base


def test_an_fp8_checkpoints_calibrated_kv_cache_scales_load_beside_its_weights(
    tiny_fp8_model, tmp_path
):
    """An FP8 checkpoint quantized with a kv_cache_scheme carries a k_scale and a v_scale per
    layer (older ones a kv_scale for both): an FP8 KV cache uses them (test_fp8_kv_cache.py
    checks the arithmetic), any other cache does not, and the weights load as without."""
    source = tiny_fp8_model("llama", "fp8-tensor")
    folder = tmp_path / "kv-scales"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    layers = config["num_hidden_layers"]
    for layer in range(layers):
        scales = {"k_scale": 0.046875, "v_scale": 0.0625, "kv_scale": 0.5}  # k and v beat kv
        for name, value in scales.items():
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    prompts = prompts_for(folder)[:3]
    llm, got = engine_greedy(folder, prompts)
    assert got == engine_greedy(source, prompts)[1]
    model = llm.engine.executor.worker.runner.model
    assert [layer.self_attn.kv_scales for layer in model.model.layers] == [None] * layers
    llm, _ = engine_greedy(folder, prompts, kv_cache_dtype="fp8")
    model = llm.engine.executor.worker.runner.model
    assert [layer.self_attn.kv_scales for layer in model.model.layers] == [
        (0.046875, 0.0625)
    ] * layers
