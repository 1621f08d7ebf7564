"""Mixture of experts (Mixtral, Qwen3-MoE) and Qwen3's config: the routed op against a token
by token reference, what config.json says, and checkpoints that do not match. Whole models
against transformers: test_llm_vs_transformers.py; TP=2: test_tensor_parallel.py; compiled:
test_compilation.py; adapters: test_lora.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tidegate.engine import LLM
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.model.moe import FusedExperts, moe_experts, route
from tidegate.engine.worker.compilation import why_no_cuda_graphs


def reference_moe(x, gate_up, down, weights, ids):
    """Each token alone: sum over its experts of weight * down(silu(gate) * up)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_experts_op_equals_each_token_through_its_experts(dtype, tolerance):
    torch.manual_seed(0)
    experts, hidden, inter, top_k = 6, 32, 24, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    for tokens in (1, 7, 40):
        x = torch.randn(tokens, hidden).to(dtype)
        logits = torch.randn(tokens, experts)
        logits[:, 5] = -1e4  # one expert no token picks
        weights, ids = route(logits, top_k, renormalize=False)
        got = moe_experts(x, gate_up, down, weights, ids)
        assert got.dtype == dtype and got.shape == x.shape
        want = reference_moe(x, gate_up, down, weights, ids)
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tolerance * scale
    empty = moe_experts(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, hidden)


def test_routing_picks_the_top_k_of_the_softmax_and_renormalises_when_asked():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 3.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids[0].tolist() == [0, 2] and sorted(ids[1].tolist()) == [1, 2]
    assert torch.allclose(weights, probs.gather(1, ids))
    weights, _ = route(logits.bfloat16(), 2, renormalize=True)
    assert weights.dtype == torch.float32  # routed in float32, as transformers does
    assert torch.allclose(weights.sum(-1), torch.ones(2))


def base_config(**changes) -> dict:
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
    }
    return {**config, **changes}


def test_qwen3_moe_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = ModelConfig.from_dict(base_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert config.moe is not None and config.qk_norm
    assert config.moe.sparse_layers == {1, 5}  # (i + 1) % 2 == 0, less layer 3
    assert [config.is_sparse_layer(i) for i in range(6)] == [0, 1, 0, 0, 0, 1]
    assert config.moe.renormalize is False  # norm_topk_prob's default
    assert config.moe.intermediate_size == 48 and config.intermediate_size == 96
    assert ModelConfig.from_dict(base_config(num_experts=0)).moe is None  # all dense
    assert ModelConfig.from_dict(base_config(mlp_only_layers=list(range(6)))).moe is None
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be between 1 and the 8"):
        ModelConfig.from_dict(base_config(num_experts_per_tok=9))


def test_mixtral_routes_every_layer_renormalised_through_its_intermediate_size():
    raw = base_config(architectures=["MixtralForCausalLM"], num_local_experts=4)
    for key in ("num_experts", "moe_intermediate_size", "head_dim"):
        raw.pop(key)
    config = ModelConfig.from_dict(raw)
    assert config.moe.sparse_layers == frozenset(range(6)) and config.moe.renormalize
    assert config.moe.num_experts == 4 and config.moe.intermediate_size == 96
    assert not config.qk_norm and config.head_dim == 16


def test_qwen3_reads_its_own_defaults_and_its_sliding_window():
    raw = base_config(architectures=["Qwen3ForCausalLM"], attention_bias=True)
    raw.pop("head_dim")
    config = ModelConfig.from_dict(raw)
    assert config.moe is None and config.qk_norm
    assert config.head_dim == 128  # Qwen3's configuration default, not hidden / heads
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == (True, True, False)
    # As transformers: the window counts only with use_sliding_window, and then for the
    # layers from max_window_layers on (Qwen3-MoE: every layer).
    raw.update(sliding_window=64, max_window_layers=4)
    assert ModelConfig.from_dict(raw).layer_windows == (0,) * 6
    windowed = ModelConfig.from_dict({**raw, "use_sliding_window": True})
    assert windowed.layer_windows == (0, 0, 0, 0, 64, 64)
    moe = ModelConfig.from_dict({**base_config(), "sliding_window": 64, "use_sliding_window": True})
    assert moe.layer_windows == (64,) * 6


def test_tensor_parallel_sizes_must_divide_the_experts_intermediate_size():
    config = ModelConfig.from_dict(base_config(moe_intermediate_size=50))
    with pytest.raises(ValueError, match="expert intermediate size 50"):
        config.check_tensor_parallel(4)
    config.check_tensor_parallel(2)


def test_experts_run_without_cuda_graphs():
    dense = ModelConfig.from_dict(base_config(architectures=["Qwen3ForCausalLM"]))
    moe = ModelConfig.from_dict(base_config())
    assert why_no_cuda_graphs(dense, 1) is None
    assert why_no_cuda_graphs(moe, 1) == "mixture of experts"
    assert why_no_cuda_graphs(dense, 2) == "pipeline parallelism"


def test_an_experts_loader_takes_its_projection_and_refuses_unknown_shards():
    experts = FusedExperts(num_experts=2, hidden_size=4, intermediate_size=3)
    gate, up, down = torch.ones(3, 4), 2 * torch.ones(3, 4), 3 * torch.ones(4, 3)
    for shard, tensor in (("gate.1", gate), ("up.1", up)):
        experts.gate_up_proj.weight_loader(experts.gate_up_proj, tensor, shard)
    experts.down_proj.weight_loader(experts.down_proj, down, "down.1")
    assert torch.equal(experts.gate_up_proj[1], torch.cat([gate, up]))
    assert torch.equal(experts.down_proj[1], down)
    for shard in ("gate.2", "left.0", "gate", None):
        with pytest.raises(ValueError, match="unknown expert shard"):
            experts.gate_up_proj.weight_loader(experts.gate_up_proj, gate, shard)


@pytest.mark.parametrize(
    ("model", "dropped"),
    [
        ("tiny_qwen3_moe_dir", "model.layers.1.mlp.experts.5.up_proj.weight"),
        ("tiny_mixtral_dir", "model.layers.0.block_sparse_moe.experts.2.w2.weight"),
    ],
)
def test_a_checkpoint_missing_one_experts_projection_is_refused(model, dropped, request, tmp_path):
    source: Path = request.getfixturevalue(model)
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights[dropped]
    save_file(weights, str(tmp_path / "model.safetensors"))
    expert = dropped.split(".experts.")[1].split(".")[0]
    kind = {"up_proj": "up", "w2": "down"}[dropped.split(".")[-2]]
    stacked = "down_proj" if kind == "down" else "gate_up_proj"
    with pytest.raises(ValueError, match=rf"missing .*experts\.{stacked}\[{kind}\.{expert}\]"):
        LLM(str(tmp_path), max_model_len=256)


def test_make_tiny_model_writes_each_architectures_checkpoint_names(
    tiny_qwen3_dir, tiny_qwen3_moe_dir, tiny_mixtral_dir
):
    qwen3 = set(load_file(tiny_qwen3_dir / "model.safetensors"))
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    assert "lm_head.weight" not in qwen3  # tied
    qwen3_moe = set(load_file(tiny_qwen3_moe_dir / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in qwen3_moe  # the dense first layer
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight"} < (
        qwen3_moe
    )
    mixtral = set(load_file(tiny_mixtral_dir / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in mixtral
    config = json.loads((tiny_mixtral_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
