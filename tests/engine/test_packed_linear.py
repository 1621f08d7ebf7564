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


def test_the_row_split_plan_takes_pieces_only_where_they_measured_faster():
    from tidegate.engine.model.packed_linear import PIECE_ROWS, choose_row_splits

    # rows: (whole, in pieces) seconds
    measured = {
        320: (1.0, 0.95),  # faster, but within the noise margin: whole
        448: (2.0, 1.2),
        512: (2.2, 1.3),
        768: (2.0, 2.5),
        1024: (5.0, 2.0),
    }
    assert choose_row_splits(measured) == [(448, PIECE_ROWS), (768, 0), (1024, PIECE_ROWS)]
    assert choose_row_splits({512: (1.0, 1.0)}) == []  # never faster: no entry at all
    assert choose_row_splits({}) == []


@needs_packing
def test_a_product_run_in_pieces_is_bitwise_the_same():
    from tidegate.engine.model.packed_linear import load_cpp_packed_linear, pack, set_row_split

    if not load_cpp_packed_linear():
        pytest.skip("the C++ op cannot be built here")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 80, generator=generator).to(BF16)
    bias = torch.randn(96, generator=generator).to(BF16)
    packed = pack(weight)
    x = torch.randn(3, 250, 80, generator=generator).to(BF16)  # 750 rows, 3-D
    op = torch.ops.tidegate_linear.packed_linear
    try:
        set_row_split(96, 80, [])
        whole = op(x, packed, bias)
        # 750 rows fall in the second entry: pieces of 64, the last one of 46 rows.
        set_row_split(96, 80, [(100, 128), (700, 64), (1000, 0)])
        assert torch.equal(op(x, packed, bias), whole)
        assert torch.equal(op(x[0, :90], packed, bias), whole[0, :90])  # below the plan
        with pytest.raises(RuntimeError, match="ascend"):
            set_row_split(96, 80, [(700, 64), (100, 128)])
    finally:
        set_row_split(96, 80, [])


@needs_packing
def test_planning_measures_each_row_count_whole_and_in_pieces_then_leaves_no_plan():
    from tidegate.engine.model.packed_linear import (
        PIECE_ROWS,
        load_cpp_packed_linear,
        pack,
        plan_row_splits,
    )

    if not load_cpp_packed_linear():
        pytest.skip("the C++ op cannot be built here")
    packed = pack(torch.randn(64, 32).to(BF16))
    calls: list[int] = []

    def timer(run):
        out = run()
        calls.append(out.shape[0])
        # Whole and pieces alternate; pieces win at 512 rows only.
        whole = len(calls) % 2 == 1
        return 1.0 if whole or out.shape[0] != 512 else 0.5

    plan = plan_row_splits(packed, max_rows=640, timer=timer)
    assert calls == [320, 320, 384, 384, 448, 448, 512, 512, 640, 640]
    assert plan == [(512, PIECE_ROWS), (640, 0)]
    # A step's own row count is measured even when the budget stops the sweep short of it,
    # and decides from there on: pieces win at 320 rows here and lose at 2,000.
    calls.clear()

    def short_sweep_timer(run):
        out = run()
        calls.append(out.shape[0])
        whole = len(calls) % 2 == 1
        return 1.0 if whole else (0.5 if out.shape[0] == 320 else 2.0)

    plan = plan_row_splits(packed, max_rows=2000, budget_s=0.0, timer=short_sweep_timer)
    assert calls == [320, 320, 2000, 2000]
    assert plan == [(320, PIECE_ROWS), (2000, 0)]
    # Measuring leaves the shape unplanned: products run whole until the plan is set.
    assert plan_row_splits(packed, max_rows=PIECE_ROWS, timer=timer) == []
