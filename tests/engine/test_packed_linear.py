"""bf16 linear weights packed for oneDNN on CPU: bitwise the same outputs, no extra copy."""

from __future__ import annotations

import pytest
import torch

from tidegate.engine.attention import TorchAttentionBackend
from tidegate.engine.model.layers import Linear, LMHead, RowParallelLinear, VocabEmbedding
from tidegate.engine.model.loader import load_model
from tidegate.engine.model.packed_linear import can_pack, pack_linear_weights
from tidegate.engine.worker.compilation import ModelCompiler, dummy_step

# Packing needs oneDNN's bf16 path: AVX-512 or AVX-NE-CONVERT. On other CPUs only the
# fallback test below runs (bf16 linears stay plain and the model still runs).
needs_packing = pytest.mark.skipif(
    not can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="this torch or CPU has no oneDNN bf16 packing (needs AVX-512 or AVX-NE-CONVERT)",
)
BF16 = torch.bfloat16
CPU = torch.device("cpu")


def filled(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return module


@pytest.fixture
def bf16_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    yield
    torch.set_default_dtype(previous)


@needs_packing
@pytest.mark.usefixtures("bf16_default")
def test_packed_layers_give_bitwise_the_same_outputs_and_drop_the_plain_weight():
    layers = [
        filled(Linear(48, 80, bias=True)),
        filled(RowParallelLinear(48, 32)),
        filled(LMHead(100, 48)),
    ]
    x = torch.randn(7, 48, dtype=BF16)
    plain = [layer(x) for layer in layers]
    holder = torch.nn.ModuleList(layers)
    assert pack_linear_weights(holder) == 3
    for layer, want in zip(layers, plain, strict=True):
        assert layer.weight is None and layer.packed is not None
        assert torch.equal(layer(x), want)
        assert torch.equal(layer(x[:1]), want[:1])  # a single-token decode too
    assert sum(p.numel() for p in holder.parameters()) == 80  # only the Linear's bias is left


@needs_packing
@pytest.mark.usefixtures("bf16_default")
def test_a_tied_lm_head_and_fp32_weights_stay_plain():
    embedding, head = VocabEmbedding(100, 48), LMHead(100, 48)
    head.tie(embedding)
    holder = torch.nn.ModuleList([embedding, filled(head)])
    assert pack_linear_weights(holder) == 0
    assert head.weight is embedding.weight and head.packed is None
    fp32 = Linear(16, 16).to(torch.float32)
    assert pack_linear_weights(fp32) == 0 and fp32.weight is not None


def model_outputs(model, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = model.config
    shape = (4, 16, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=BF16), torch.zeros(shape, dtype=BF16))] * len(
        model.model.layers
    )
    _, positions, meta = dummy_step(num_tokens, 16, CPU)
    ids = torch.arange(5, 5 + num_tokens)
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
        return hidden, model.compute_logits(hidden)


@needs_packing
@pytest.mark.parametrize(("arch", "packed"), [("llama", 4 * 2 + 1), ("qwen2", 4 * 2)])
def test_a_packed_bf16_model_computes_bitwise_the_same_logits(
    arch, packed, tiny_llama_dir, tiny_qwen2_dir
):
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    model, _ = load_model(folder, BF16, CPU, TorchAttentionBackend())
    want = [model_outputs(model, n) for n in (1, 7)]
    # Per layer qkv, o, gate_up and down; the LM head unless tied (qwen2's is).
    assert pack_linear_weights(model) == packed
    for n, (hidden, logits) in zip((1, 7), want, strict=True):
        got_hidden, got_logits = model_outputs(model, n)
        assert torch.equal(got_hidden, hidden) and torch.equal(got_logits, logits)


@needs_packing
@pytest.mark.slow
def test_torch_compile_takes_packed_linears_without_recompiling(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, BF16, CPU, TorchAttentionBackend())
    pack_linear_weights(model)
    eager = {n: model_outputs(model, n)[0] for n in (1, 5, 17)}
    compiler = ModelCompiler()
    compiler.compile(model.model)
    for n, want in eager.items():
        got = model_outputs(model, n)[0]
        # Fusion changes bf16 rounding, never the scale of the result.
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    assert compiler.num_graphs == 2  # the one-token graph and the dynamic one


def test_a_cpu_without_onednn_bf16_keeps_plain_weights_and_still_runs(tiny_llama_dir, monkeypatch):
    from tidegate.engine.model import packed_linear

    monkeypatch.setattr(packed_linear, "cpu_packs_bf16", lambda: False)
    model, _ = load_model(tiny_llama_dir, BF16, CPU, TorchAttentionBackend())
    assert pack_linear_weights(model) == 0
    assert all(getattr(m, "packed", None) is None for m in model.modules())
    _, logits = model_outputs(model, 7)
    assert logits.shape[0] == 7 and torch.isfinite(logits).all()
