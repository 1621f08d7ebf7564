"""The CPU LoRA delta's three forms (one adapter for every row, a masked product over every
slot for small batches, per-slot products for large ones) against a row-by-row reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidegate.engine.lora import ops
from tidegate.engine.lora.ops import LoRAMapping, LoRAWeights, reference_delta
from tidegate.engine.model.packed_linear import cpu_packs_bf16

K, N, W, S = 96, 80, 24, 3


def mapping_for(token_slots: list[int]) -> LoRAMapping:
    slots = np.asarray(token_slots)
    segments = [
        (s, torch.from_numpy(np.flatnonzero(slots == s))) for s in range(S) if (slots == s).any()
    ]
    return LoRAMapping(
        sorted_token_ids=torch.zeros(len(slots), dtype=torch.int32),
        slot_starts=torch.zeros(S + 1, dtype=torch.int32),
        segments=segments,
        token_slots=torch.from_numpy(slots),
        num_tokens=len(slots),
    )


def delta(dtype: torch.dtype, token_slots: list[int], seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), K, generator=generator).to(dtype)
    a = (torch.randn(S, W, K, generator=generator) / K**0.5).to(dtype)
    b = (torch.randn(N, S * W, generator=generator) / W**0.5).to(dtype)
    weights = LoRAWeights(a_stack=a.clone(), b_all=b.clone())
    weights.repack()
    index = ops.register_weights(weights)
    y = torch.randn(len(token_slots), N, generator=generator).to(dtype)
    before = y.clone()
    ops.set_mapping(mapping_for(token_slots))
    try:
        ops.lora_delta(x, y, index)
    finally:
        ops.set_mapping(None)
    expected = reference_delta(x, a, weights.b_stack, token_slots)
    return before, y, expected


MIXED = [0, 2, -1, 1, 0, 0, 2, -1, 1]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "token_slots",
    [MIXED, [1] * 7, MIXED * 34, MIXED * 130],
    ids=["mixed-small", "one-adapter", "mixed-300", "mixed-1170"],
)
def test_every_form_adds_each_rows_own_adapter_delta(dtype, token_slots, fused, monkeypatch):
    """Small batches go to the fused kernel (where it builds) or one masked product over
    every slot; long ones to per-slot products; one adapter for all rows skips the mask."""
    if fused and not ops.fused_kernel_available():
        pytest.skip("the fused LoRA kernel does not build here")
    if not fused:
        monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 0)
    before, y, expected = delta(dtype, token_slots)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        (y.float() - before.float()), expected, atol=tolerance, rtol=tolerance
    )
    base_rows = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y[base_rows], before[base_rows])  # no adapter: exactly unchanged


@pytest.mark.skipif(not cpu_packs_bf16(), reason="this CPU has no oneDNN bf16 packing")
def test_bf16_small_batches_use_the_packed_weights():
    weights = LoRAWeights(
        a_stack=torch.zeros(S, W, K, dtype=torch.bfloat16),
        b_all=torch.zeros(N, S * W, dtype=torch.bfloat16),
    )
    weights.repack()
    assert weights.a_packed is not None and weights.b_packed is not None


def test_no_mapping_or_no_adapter_rows_change_nothing():
    before, y, _ = delta(torch.float32, [-1, -1, -1])
    assert torch.equal(y, before)
