"""The Triton LoRA kernels equal a per-slot torch reference, and touch only their tokens' rows.

`lora_shrink` / `lora_expand` / `lora_apply` take a segment mapping (token rows grouped by
adapter slot, plus each slot's start); tokens in no segment use the base model. Without a GPU
the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set here before triton is
imported); with one, natively. Shapes stay small so the interpreter gets through the file
quickly.
"""

from __future__ import annotations

import os

import pytest
import torch

# Before anything imports triton: without a GPU, its kernels must run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton LoRA kernels need the triton package")

from tidegate.engine.lora.triton_ops import lora_apply, lora_expand, lora_shrink

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# atol = rtol against an fp32 reference from the same (rounded) inputs. 16-bit error comes
# from rounding y once, plus tf32 rounding of h in the expand on a GPU.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BASE = -1  # a token's slot when it uses no adapter
SENTINEL = 1234.5  # written into outputs first, to see which rows a kernel left alone


def segment_mapping(slots: list[int], num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, slot_starts) for per-token slots, `BASE` for no adapter.

    Rows keep their order within a slot. Padding entries (one per base token) are poisoned
    with a base token's row, so a kernel that read them would change a row it must not touch.
    """
    order = [t for s in range(num_slots) for t in range(len(slots)) if slots[t] == s]
    starts = [0]
    for s in range(num_slots):
        starts.append(starts[-1] + slots.count(s))
    padding = base_rows(slots)
    order += [padding[0]] * len(padding) if padding else []
    return (
        torch.tensor(order, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
    )


def make_case(slots, num_slots, rank, hidden, out_features, dtype, ranks=None, seed=0):
    """Random x, stacks (slot s zero padded past ranks[s]) and y, already rounded to dtype."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(slots)
    x = torch.randn(num_tokens, hidden, generator=gen)
    a = torch.randn(num_slots, rank, hidden, generator=gen) / hidden**0.5
    b = torch.randn(num_slots, out_features, rank, generator=gen) / rank**0.5
    y = torch.randn(num_tokens, out_features, generator=gen)
    for s, r in enumerate(ranks or [rank] * num_slots):
        a[s, r:] = 0
        b[s, :, r:] = 0
    return tuple(t.to(dtype).to(DEVICE) for t in (x, a, b, y))


def reference_shrink(x, a, sorted_ids, starts, out):
    out = out.clone()
    for s in range(a.shape[0]):
        rows = sorted_ids[starts[s] : starts[s + 1]].long()
        out[rows] = x[rows].float() @ a[s].float().T
    return out


def reference_expand(h, b, sorted_ids, starts, y):
    y = y.clone()
    for s in range(b.shape[0]):
        rows = sorted_ids[starts[s] : starts[s + 1]].long()
        y[rows] = (y[rows].float() + h[rows] @ b[s].float().T).to(y.dtype)
    return y


def base_rows(slots: list[int]) -> list[int]:
    return [t for t, s in enumerate(slots) if s == BASE]


def interleaved_slots(num_tokens: int, num_slots: int, empty_slot: int | None) -> list[int]:
    """Per-token slots that jump around (so each slot's rows are non-contiguous), some tokens
    on the base model, and `empty_slot` never used."""
    used = [s for s in range(num_slots) if s != empty_slot] + [BASE]
    return [used[(t * 7 + t // 5) % len(used)] for t in range(num_tokens)]


# ---------------------------------------------------------------------------------------------


def test_shrink_fp32_matches_reference_and_leaves_base_rows():
    """fp32 shrink, T=45 (not a multiple of the token tile; slot 0's 18 rows span two tiles),
    K=100 (not a multiple of BLOCK_K), R=16 with a rank-5 slot, interleaved rows: h equals
    x @ A_s^T tightly; base rows keep the sentinel bit for bit."""
    slots = interleaved_slots(45, 3, empty_slot=None)
    x, a, _, _ = make_case(slots, 3, 16, 100, 8, torch.float32, ranks=[16, 5, 16])
    ids, starts = segment_mapping(slots, 3)
    out = torch.full((45, 16), SENTINEL, device=DEVICE)
    expected = reference_shrink(x, a, ids.cpu(), starts.cpu(), out)
    lora_shrink(x, a, ids, starts, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[base_rows(slots)], expected[base_rows(slots)])
    # The zero-padded rank columns of the rank-5 slot come out exactly zero.
    slot1_rows = [t for t, s in enumerate(slots) if s == 1]
    assert torch.equal(out[slot1_rows, 5:], torch.zeros(len(slot1_rows), 11, device=DEVICE))


def test_expand_fp32_matches_reference_and_leaves_base_rows():
    """fp32 expand, N=72 (not a multiple of BLOCK_N), R=8 (below the 16-wide rank tile):
    y += h @ B_s^T tightly; base rows bitwise unchanged, even where their h is garbage."""
    slots = interleaved_slots(21, 2, empty_slot=None)
    _, _, b, y = make_case(slots, 2, 8, 16, 72, torch.float32)
    ids, starts = segment_mapping(slots, 2)
    h = torch.randn(21, 8, device=DEVICE)
    h[base_rows(slots)] = float("nan")  # never read: a read would poison y
    expected = reference_expand(h, b, ids.cpu(), starts.cpu(), y)
    before = y.clone()
    lora_expand(h, b, ids, starts, y)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[base_rows(slots)], before[base_rows(slots)])


@pytest.mark.parametrize(
    ("dtype", "rank", "ranks"),
    [
        pytest.param(torch.float32, 16, [16, 0, 4, 16], id="fp32-r16"),
        pytest.param(torch.bfloat16, 8, [8, 0, 3, 8], id="bf16-r8"),
        pytest.param(torch.float16, 16, [16, 0, 12, 16], id="fp16-r16"),
    ],
)
def test_apply_several_slots_matches_reference(dtype, rank, ranks):
    """lora_apply over 4 slots with interleaved rows, slot 1 empty and one slot of smaller
    (zero-padded) rank, T=41 (slot 0's 17 rows span two token tiles), K=72, N=40: y matches the reference within the dtype's
    tolerance; base-model rows are bitwise unchanged."""
    slots = interleaved_slots(41, 4, empty_slot=1)
    x, a, b, y = make_case(slots, 4, rank, 72, 40, dtype, ranks=ranks, seed=1)
    ids, starts = segment_mapping(slots, 4)
    assert starts[1] == starts[2]  # slot 1 is empty
    h = reference_shrink(x, a, ids.cpu(), starts.cpu(), torch.zeros(41, rank, device=DEVICE))
    expected = reference_expand(h, b, ids.cpu(), starts.cpu(), y)
    before = y.clone()
    # A shared scratch buffer, larger than this call needs: T_max > T and R_max > R.
    buffer = torch.full((64, 32), SENTINEL, device=DEVICE)
    lora_apply(x, y, a, b, ids, starts, buffer)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(y[base_rows(slots)], before[base_rows(slots)])
    # Only buffer[:T, :R] is the shrink's; the rest is left alone.
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[:41, :rank] = False
    assert torch.all(buffer[untouched] == SENTINEL)


def test_apply_on_strided_views_of_merged_tensors():
    """x and y as column slices of wider tensors (y one projection of a merged q+k+v output):
    the kernels follow the row strides and write no column outside y's slice."""
    slots = [0, BASE, 1, 1, 0, BASE, 0]
    x, a, b, _ = make_case(slots, 2, 16, 48, 24, torch.bfloat16, seed=2)
    wide_x = torch.randn(7, 80, device=DEVICE).to(torch.bfloat16)
    wide_x[:, 16:64] = x
    merged = torch.randn(7, 72, device=DEVICE).to(torch.bfloat16)
    before = merged.clone()
    y = merged[:, 24:48]
    ids, starts = segment_mapping(slots, 2)
    h = reference_shrink(x, a, ids.cpu(), starts.cpu(), torch.zeros(7, 16, device=DEVICE))
    expected = reference_expand(h, b, ids.cpu(), starts.cpu(), y)
    lora_apply(wide_x[:, 16:64], y, a, b, ids, starts)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(y.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(merged[:, :24], before[:, :24])
    assert torch.equal(merged[:, 48:], before[:, 48:])
    assert torch.equal(merged[base_rows(slots)], before[base_rows(slots)])


def test_single_token():
    """A batch of one token on slot 2 of 3 (slots 0 and 1 empty) gets exactly its delta."""
    x, a, b, y = make_case([2], 3, 16, 40, 24, torch.float32, seed=3)
    ids = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    expected = y + (x @ a[2].T) @ b[2].T
    lora_apply(x, y, a, b, ids, starts)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_no_token_on_any_adapter_leaves_everything_unchanged():
    """All tokens on the base model (every segment empty, all of sorted_token_ids padding):
    y and the shrink buffer stay bitwise as they were."""
    x, a, b, y = make_case([BASE] * 5, 2, 8, 32, 16, torch.bfloat16, seed=4)
    ids = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    before = y.clone()
    buffer = torch.full((5, 8), SENTINEL, device=DEVICE)
    lora_apply(x, y, a, b, ids, starts, buffer)
    assert torch.equal(y, before)
    assert torch.equal(buffer, torch.full((5, 8), SENTINEL, device=DEVICE))


def test_mapping_values_change_without_a_new_launch_shape():
    """The same tensors, with the mapping rewritten in place (as a CUDA-graph replay would
    see it), give the new mapping's result: nothing about the launch was fixed by values."""
    slots_a = [0, 1, BASE, 0, 1, 1]
    slots_b = [1, BASE, 0, 0, BASE, 1]
    x, a, b, y0 = make_case(slots_a, 2, 16, 24, 20, torch.float32, seed=5)
    ids, starts = segment_mapping(slots_a, 2)
    buffer = torch.empty(6, 16, device=DEVICE)
    for slots in (slots_a, slots_b):
        new_ids, new_starts = segment_mapping(slots, 2)
        ids.copy_(new_ids)
        starts.copy_(new_starts)
        y = y0.clone()
        lora_apply(x, y, a, b, ids, starts, buffer)
        expected = y0.clone()
        for t, s in enumerate(slots):
            if s != BASE:
                expected[t] += (x[t] @ a[s].T) @ b[s].T
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(y[base_rows(slots)], y0[base_rows(slots)])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_apply_replays_in_a_cuda_graph():
    """lora_apply captured once in a CUDA graph follows mapping values written before each
    replay (the launch grid depends on shapes only; no host sync in the capture)."""
    slots_a = [0, 1, BASE, 0, 1, 1, 0, BASE]
    slots_b = [BASE, BASE, 1, 1, 1, 0, 0, 1]
    x, a, b, y0 = make_case(slots_a, 2, 16, 64, 48, torch.bfloat16, seed=6)
    ids, starts = segment_mapping(slots_a, 2)
    y = y0.clone()
    buffer = torch.empty(8, 16, device=DEVICE)
    lora_apply(x, y, a, b, ids, starts, buffer)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(x, y, a, b, ids, starts, buffer)
    for slots in (slots_a, slots_b):
        new_ids, new_starts = segment_mapping(slots, 2)
        ids.copy_(new_ids)
        starts.copy_(new_starts)
        y.copy_(y0)
        graph.replay()
        h = torch.zeros(8, 16, device=DEVICE)
        h = reference_shrink(x, a, new_ids.cpu(), new_starts.cpu(), h)
        expected = reference_expand(h, b, new_ids.cpu(), new_starts.cpu(), y0)
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(y.float(), expected.float(), atol=tol, rtol=tol)
        assert torch.equal(y[base_rows(slots)], y0[base_rows(slots)])


def test_rejects_mismatched_shapes_and_dtypes():
    """Wrong shapes or dtypes raise ValueError before any launch."""
    x, a, b, y = make_case([0, 0], 1, 8, 16, 16, torch.float32)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        lora_apply(x, y, a, b, ids.long(), starts)
    with pytest.raises(ValueError, match="slot_starts"):
        lora_apply(x, y, a, b, ids, starts[:1])
    with pytest.raises(ValueError, match="dtype"):
        lora_apply(x, y, a.to(torch.bfloat16), b, ids, starts)
    with pytest.raises(ValueError, match="out must be float32"):
        lora_shrink(x, a, ids, starts, torch.empty(2, 8, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="buffer"):
        lora_apply(x, y, a, b, ids, starts, torch.empty(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="buffer"):
        lora_apply(x, y, a, b, ids, starts, torch.empty(2, 4, device=DEVICE))
