"""cpu_attention: the C++ paged-attention kernel against the torch backend, on this CPU.

Shapes of the small model's attention (12 query heads, 4 KV heads, head size 64), bf16,
block size 16, block ids shuffled as a long-running server leaves them; one layer's call,
with torch's threads as the engine sets them. The torch backend gathers each context out of
the cache and runs SDPA (one batched call for the decodes, one per prefill chunk); the `cpu`
backend reads the cache in place, the whole batch in one call. Each backend gets the same
keys and values in its own cache layout (standard for torch, packed for cpu). Scenarios are the batches a
serving step of the benchmark workload makes: 32 decodes of 128-640 tokens, the same at
2,048 tokens, one 512-token fresh prompt, a 512-token chunk after 2,048 cached tokens (the
prefill-stall case), that chunk beside 31 decodes, a 16-token chunk after 3,000 cached tokens
beside 16 decodes (what auto chunking runs deep into a long prompt), and one decode of a
16,384-token context. `--kv-cache-dtype fp8` stores both backends' caches in FP8 (each
widens as it reads: torch when it gathers, the kernel per chunk), for comparison with a run
in the model's dtype.

    python benchmarks/cpu_attention.py    # writes benchmarks/results/cpu_attention.json
    python benchmarks/cpu_attention.py --dtype float32 --kv-cache-dtype fp8 \
        --out benchmarks/results/cpu_attention_fp8_kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch

from tidegate.engine.attention import TorchAttentionBackend
from tidegate.engine.attention.backend import (
    AttentionMetadata,
    KVLayout,
    kv_cache_dtype,
    to_cache_dtype,
)
from tidegate.engine.attention.cpu_attention import AMX_MAX_KERNEL_QUERY_LEN, CpuAttentionBackend

ROOT = Path(__file__).resolve().parent.parent
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16


def scenarios(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    """(context_len, query_len) per sequence."""
    return {
        "decode_32x128-640": [(rng.randint(128, 640), 1) for _ in range(32)],
        "decode_32x2048": [(2047, 1)] * 32,
        "prefill_512": [(0, 512)],
        "chunk_512_after_2048": [(2048, 512)],
        "chunk_512_after_2048_with_31_decodes": [(2048, 512)]
        + [(rng.randint(128, 640), 1) for _ in range(31)],
        # What auto chunking runs deep into a long prompt: one block beside the streams.
        "chunk_16_after_3000_with_16_decodes": [(3000, 16)]
        + [(rng.randint(128, 640), 1) for _ in range(16)],
        "decode_1x16384": [(16383, 1)],
    }


def make_batch(
    chunks, rng: random.Random, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
):
    """(query, k_cache, v_cache, meta), the caches in the standard layout (of `cache_dtype`,
    default the query's)."""
    cache_dtype = cache_dtype or dtype
    needed = [-(-(c + q) // BLOCK_SIZE) for c, q in chunks]
    num_blocks = sum(needed) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    width = max(needed)
    block_table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for _, q in chunks:
        starts.append(starts[-1] + q)
    seq_lens = torch.tensor([c + q for c, q in chunks], dtype=torch.int32)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        num_seqs=len(chunks),
        num_tokens=starts[-1],
        max_query_len=max(q for _, q in chunks),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = to_cache_dtype(torch.randn(shape).to(dtype), cache_dtype)
    v_cache = to_cache_dtype(torch.randn(shape).to(dtype), cache_dtype)
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM).to(dtype)
    return query, k_cache, v_cache, meta


def in_layout(batch, layout: KVLayout):
    """The batch with its caches in a backend's layout (the cpu backend's is packed)."""
    query, k_cache, v_cache, meta = batch
    return (query, *layout.from_standard(k_cache, v_cache), meta)


def time_calls(calls: dict, warmup: int, iters: int, repeats: int) -> dict[str, float]:
    """Median ms per call of each callable, repeats alternating between them."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - start) / iters * 1000)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu_attention.json")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cache_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    rng = random.Random(0)
    # cpu: the backend as the engine runs it on this CPU; kernel: every sequence through the
    # C++ kernel; kernel_sdpa: chunks over 64 tokens to SDPA, as on a CPU with AMX. The last
    # two show which split pays here.
    backends = {
        "torch": TorchAttentionBackend(),
        "cpu": CpuAttentionBackend(),
        "kernel": CpuAttentionBackend(max_kernel_query_len=0),
        "kernel_sdpa": CpuAttentionBackend(max_kernel_query_len=AMX_MAX_KERNEL_QUERY_LEN),
    }
    scale = HEAD_DIM**-0.5
    rows = []
    for name, chunks in scenarios(rng).items():
        batch = make_batch(chunks, rng, dtype, cache_dtype)
        layouts = {b.kv_layout for b in backends.values()}
        batches = {layout: in_layout(batch, layout) for layout in layouts}
        calls = {n: partial(b.attend, *batches[b.kv_layout], scale) for n, b in backends.items()}
        outs = {n: fn() for n, fn in calls.items()}
        times = time_calls(calls, 2, args.iters, args.repeats)
        row = {"scenario": name, "tokens": batch[3].num_tokens}
        row.update({f"{n}_ms": round(t, 3) for n, t in times.items()})
        row["speedup_cpu_vs_torch"] = round(times["torch"] / times["cpu"], 2)
        row["max_abs_diff"] = float((outs["cpu"].float() - outs["torch"].float()).abs().max())
        rows.append(row)
        print(json.dumps(row))
    result = {
        "benchmark": "cpu_attention",
        "dtype": args.dtype,
        "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
        "shape": {"heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "block_size": BLOCK_SIZE,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": _commit(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
