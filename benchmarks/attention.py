"""attention: the Triton paged-attention kernel against PyTorch SDPA on dense K/V, on CUDA.

Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head size 128), bf16, block size 16,
block ids shuffled as a long-running server leaves them. Scenarios: a decode-heavy batch (64
sequences of 4,096 tokens, one new token each), a prefill-heavy batch (4 fresh prompts of
2,048 tokens), a mixed batch (one 2,048-token chunk after 2,048 cached tokens beside 63
decodes) and few long decodes (4 x 32,768 tokens, where split-KV matters; timed with the
split forced on and off). SDPA gets K/V already gathered into dense tensors — the copy it
would need is timed apart — so it is the bar a paged kernel has to reach, not a strawman.

Reported per scenario: milliseconds per call (median of repeats, CUDA events, after
warmup), achieved bandwidth (K/V read + Q read + output written, divided by time) and
TFLOP/s (4 * heads * head size per visible query-key pair). `--check` first compares the
kernel with a dense fp32 reference on small random batches (mixed prefill/decode, every
head size, GQA ratio and dtype, split-KV on and off, sliding window) and stops on a mismatch.

    python benchmarks/attention.py --check       # writes benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
# (context_len, query_len) per sequence; the split-KV scenario is also timed forced off.
SCENARIOS = {
    "decode": [(4095, 1)] * 64,
    "prefill": [(0, 2048)] * 4,
    "mixed": [(2048, 2048)] + [(4095, 1)] * 63,
    "long_decode": [(32767, 1)] * 4,
}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention.json")
    parser.add_argument("--check", action="store_true", help="correctness check before timing")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; median kept")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/attention.py needs a CUDA GPU: it times Triton kernels natively "
            "(on CPU, tests/engine/test_triton_attention.py checks them in the interpreter)"
        )
    from tidegate.engine.attention.triton_attention import unified_attention

    if args.check:
        failures = check(unified_attention)
        if failures:
            raise SystemExit("correctness check failed:\n" + "\n".join(failures))
        print("correctness check passed", flush=True)

    results = {}
    for name, chunks in SCENARIOS.items():
        results[name] = run_scenario(name, chunks, unified_attention, args)
        print(json.dumps({name: results[name]}, indent=2), flush=True)
    record = {
        "benchmark": "attention",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": str(DTYPE).removeprefix("torch."),
        },
        "machine": machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


def run_scenario(name: str, chunks: list[tuple[int, int]], unified_attention, args) -> dict:
    """Time the kernel and SDPA on one batch; check they agree; derive bandwidth and FLOP/s."""
    batch = paged_batch(chunks, NUM_HEADS, DTYPE, seed=len(name))
    q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def kernel(split_kv=None):
        unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            batch["query_start_loc"],
            batch["seq_lens"],
            batch["block_table"],
            scale,
            max_query_len=max(n for _, n in chunks),
            max_seq_len=max(c + n for c, n in chunks),
            split_kv=split_kv,
        )

    groups = dense_groups(chunks, batch)
    backends = pick_sdpa_backends(groups, scale)

    def baseline():
        return [sdpa_call(g, scale, how) for g, how in zip(groups, backends, strict=True)]

    traffic, flops = traffic_bytes(chunks, DTYPE), attention_flops(chunks)
    row = {
        "sequences": len(chunks),
        "new_tokens": q.shape[0],
        "kv_tokens": sum(map(sum, chunks)),
        "bytes_moved": traffic,
        "flops": flops,
        "sdpa_backends": backends,
    }
    variants = {"unified": kernel}
    if name == "long_decode":
        variants["unified_split_on"] = lambda: kernel(True)
        variants["unified_split_off"] = lambda: kernel(False)
    for label, fn in variants.items():
        ms = time_ms(fn, args)
        row[label] = {"ms": ms, **rates(traffic, flops, ms)}
    ms = time_ms(baseline, args)
    row["sdpa_dense_kv"] = {"ms": ms, **rates(traffic, flops, ms)}
    row["gather_kv_for_sdpa_ms"] = time_ms(lambda: [gather_kv(g, batch) for g in groups], args)
    row["speedup_vs_sdpa"] = ms / row["unified"]["ms"]
    row["speedup_vs_gather_plus_sdpa"] = (ms + row["gather_kv_for_sdpa_ms"]) / row["unified"]["ms"]

    kernel()
    expected = scatter_back(groups, baseline(), q.shape)
    row["max_abs_diff_vs_sdpa"] = (out.float() - expected.float()).abs().max().item()
    return row


def paged_batch(chunks, num_heads, dtype, seed, head_dim=HEAD_DIM, block_size=BLOCK_SIZE):
    """A paged cache and metadata for (context_len, query_len) sequences on shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in chunks]
    order = torch.randperm(sum(needed) + 1, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n])
        start += n
    width = max(needed) + 1
    padded = [t + [-1] * (width - len(t)) for t in tables]
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    cache_shape = (len(order), block_size, NUM_KV_HEADS, head_dim)
    dev = "cuda"
    return {
        "q": torch.randn(starts[-1], num_heads, head_dim, device=dev).to(dtype),
        "k_cache": torch.randn(cache_shape, device=dev).to(dtype),
        "v_cache": torch.randn(cache_shape, device=dev).to(dtype),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=dev),
        "seq_lens": torch.tensor([c + n for c, n in chunks], dtype=torch.int32, device=dev),
        "block_table": torch.tensor(padded, dtype=torch.int32, device=dev),
        "tables": tables,
        "starts": starts,
    }


def dense_groups(chunks, batch) -> list[dict]:
    """Sequences of one shape stacked as SDPA wants them: q [B, H, L, D], K/V [B, Hkv, S, D]."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, chunk in enumerate(chunks):
        by_shape.setdefault(chunk, []).append(i)
    groups = []
    for (context_len, query_len), members in by_shape.items():
        rows = torch.cat(
            [torch.arange(batch["starts"][i], batch["starts"][i + 1]) for i in members]
        ).cuda()
        q = batch["q"][rows].view(len(members), query_len, NUM_HEADS, HEAD_DIM)
        group = {
            "q": q.transpose(1, 2).contiguous(),
            "blocks": torch.tensor([batch["tables"][i] for i in members], device="cuda"),
            "seq_len": context_len + query_len,
            "context_len": context_len,
            "rows": rows,
        }
        gather_kv(group, batch)
        groups.append(group)
    return groups


def gather_kv(group: dict, batch: dict) -> None:
    """The copy SDPA needs first: the group's K/V out of the paged cache, dense, heads first."""
    for name, cache in (("k", batch["k_cache"]), ("v", batch["v_cache"])):
        dense = cache[group["blocks"]].flatten(1, 2)[:, : group["seq_len"]]
        group[name] = dense.transpose(1, 2).contiguous()


def sdpa_call(group: dict, scale: float, how: str) -> torch.Tensor:
    """SDPA on one group, causal with the new tokens at the bottom right of the keys.

    "flash" forces FlashAttention (GQA without repeating K/V; a chunk after cached context
    uses PyTorch's lower-right causal bias); "default" lets PyTorch choose, with a boolean mask.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = group["q"], group["k"], group["v"]
    query_len, seq_len = q.shape[2], k.shape[2]
    fresh_prompt = query_len > 1 and group["context_len"] == 0
    chunk_after_context = query_len > 1 and group["context_len"] > 0
    if how == "flash":
        mask = causal_lower_right(query_len, seq_len) if chunk_after_context else None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=fresh_prompt, scale=scale, enable_gqa=True
            )
    mask = None
    if chunk_after_context:
        pos = torch.arange(seq_len, device="cuda")
        mask = pos[None, :] <= pos[group["context_len"] :, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=fresh_prompt, scale=scale, enable_gqa=True
    )


def pick_sdpa_backends(groups, scale) -> list[str]:
    """Per group: FlashAttention where this PyTorch build takes it, else PyTorch's choice."""
    chosen = []
    for group in groups:
        try:
            sdpa_call(group, scale, "flash")
            chosen.append("flash")
        except (RuntimeError, TypeError, NotImplementedError):
            chosen.append("default")
    return chosen


def scatter_back(groups, outs, shape) -> torch.Tensor:
    """SDPA's per-group outputs back into the flat [num_tokens, H, D] order."""
    flat = torch.empty(shape, dtype=DTYPE, device="cuda")
    for group, o in zip(groups, outs, strict=True):
        flat[group["rows"]] = o.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)
    return flat


def time_ms(fn, args) -> float:
    """Median over repeats of the mean time per call, from CUDA events, after warmup."""
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / args.iters)
    return statistics.median(per_call)


def traffic_bytes(chunks, dtype) -> int:
    """Bytes a perfect kernel moves: each sequence's K and V once, Q read, output written."""
    item = torch.finfo(dtype).bits // 8
    kv = sum(c + n for c, n in chunks) * NUM_KV_HEADS * HEAD_DIM * item * 2
    q_and_out = sum(n for _, n in chunks) * NUM_HEADS * HEAD_DIM * item * 2
    return kv + q_and_out


def attention_flops(chunks) -> int:
    """2 matmuls x 2 FLOP per multiply-add, over each query's visible keys only."""
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in chunks)
    return 4 * NUM_HEADS * HEAD_DIM * pairs


def rates(traffic: int, flops: int, ms: float) -> dict:
    """Achieved GB/s and TFLOP/s for one call of `ms` milliseconds."""
    return {"gb_per_s": traffic / ms / 1e6, "tflop_per_s": flops / ms / 1e9}


def check(unified_attention) -> list[str]:
    """Small random batches against a dense fp32 reference; one message per mismatch."""
    failures = []
    configs = [
        (64, 16, 1, torch.float32),
        (80, 32, 2, torch.bfloat16),
        (96, 64, 4, torch.float16),
        (128, 16, 8, torch.bfloat16),
        (256, 32, 2, torch.float16),
        (128, 16, 4, torch.float32),
    ]
    for head_dim, block_size, group, dtype in configs:
        for split_kv in (False, True):
            for window in (None, 40):
                rng = random.Random(head_dim + block_size + group)
                chunks = [(rng.randint(0, 300), rng.choice([1, 1, rng.randint(2, 90)]))]
                chunks += [(rng.randint(0, 300), rng.choice([1, rng.randint(2, 90)]))]
                chunks += [(rng.randint(0, 2000), 1) for _ in range(5)] + [(0, 1)]
                num_heads = NUM_KV_HEADS * group
                b = paged_batch(chunks, num_heads, dtype, 1, head_dim, block_size)
                out = torch.empty_like(b["q"])
                scale = head_dim**-0.5
                unified_attention(
                    b["q"],
                    b["k_cache"],
                    b["v_cache"],
                    out,
                    b["query_start_loc"],
                    b["seq_lens"],
                    b["block_table"],
                    scale,
                    sliding_window=window,
                    split_kv=split_kv,
                )
                expected = dense_reference(b, chunks, scale, window)
                err = (out.float() - expected).abs() - TOLERANCE[dtype] * expected.abs()
                if err.max().item() > TOLERANCE[dtype]:
                    failures.append(
                        f"head {head_dim}, block {block_size}, group {group}, {dtype}, "
                        f"split {split_kv}, window {window}: max error "
                        f"{(out.float() - expected).abs().max().item():.3g}"
                    )
    return failures


def dense_reference(batch, chunks, scale, window) -> torch.Tensor:
    """Per sequence: fp32 scores over its gathered keys with an explicit causal mask."""
    q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
    group = q.shape[1] // k_cache.shape[2]
    outs = []
    for i, (context_len, query_len) in enumerate(chunks):
        seq_len = context_len + query_len
        blocks = torch.tensor(batch["tables"][i], device="cuda")
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        rows = q[batch["starts"][i] : batch["starts"][i + 1]].float()
        scores = torch.einsum("lhd,shd->hls", rows, keys) * scale
        pos = torch.arange(seq_len, device="cuda")
        query_pos = pos[context_len:, None]
        allowed = pos[None, :] <= query_pos
        if window is not None:
            allowed &= pos[None, :] > query_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", scores.softmax(-1), values))
    return torch.cat(outs)


def machine() -> dict:
    """Where a result was measured."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }


if __name__ == "__main__":
    main()
