"""cpu_attention_cold: decode attention as the engine runs it, one layer after another.

`cpu_attention.py` calls one layer's attention again and again on one cache, which stays in
the last-level cache after the first call: it times compute. In a decode step each layer
reads its own cache, so every call finds its keys and values in memory. This calls the
`cpu` backend on `--layers` caches in turn (the small model's shapes: 12 heads, 4 KV heads,
head size 64, bf16, block 16, shuffled block ids) and reports both: warm (one cache, again
and again) and cold (a different cache each call). `--source` builds another version of the
kernel instead of this checkout's, for before/after pairs (each in its own process); a kernel
from before the packed cache layout needs `--kv-layout standard`.

    python benchmarks/cpu_attention_cold.py   # writes results/cpu_attention_cold.json
    git show REV:engine/attention/paged_attention.cpp > /tmp/before.cpp
    python benchmarks/cpu_attention_cold.py --source /tmp/before.cpp --label before
    # (add --kv-layout standard if REV's kernel reads the standard layout)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from cpu_attention import HEAD_DIM, NUM_KV_HEADS, in_layout, make_batch

import tidegate.engine.attention.cpu_attention as cpu_attention
from tidegate.engine.attention.backend import STANDARD_KV_LAYOUT

ROOT = Path(__file__).resolve().parent.parent
CASES = [(8, 630), (32, 630), (1, 630), (32, 2047)]  # (decodes, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="kernel source to build (default: this one)")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument(
        "--kv-layout",
        choices=["packed", "standard"],
        default="packed",
        help="the caches' layout: standard for a --source kernel from before the packed one",
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/cpu_attention_cold.json"
    )
    args = parser.parse_args()
    if args.source is not None:
        cpu_attention.SOURCE = args.source.resolve()
    backend = cpu_attention.CpuAttentionBackend()
    layout = backend.kv_layout if args.kv_layout == "packed" else STANDARD_KV_LAYOUT
    scale = HEAD_DIM**-0.5
    rows = []
    for decodes, context in CASES:
        chunks = [(context, 1)] * decodes
        layers = [
            in_layout(make_batch(chunks, random.Random(i), torch.bfloat16), layout)
            for i in range(args.layers)
        ]
        warm, cold = [], []
        for layer in layers:
            backend.attend(*layer, scale)
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.layers):
                backend.attend(*layers[0], scale)
            warm.append((time.perf_counter() - start) / args.layers * 1e6)
            start = time.perf_counter()
            for layer in layers:
                backend.attend(*layer, scale)
            cold.append((time.perf_counter() - start) / args.layers * 1e6)
        kv_bytes = decodes * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
        row = {
            "decodes": decodes,
            "context": context,
            "warm_us": round(statistics.median(warm), 1),
            "cold_us": round(statistics.median(cold), 1),
            "cold_gb_per_s": round(kv_bytes / statistics.median(cold) / 1e3, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    record = {
        "benchmark": "cpu_attention_cold",
        "label": args.label,
        "source": str(args.source) if args.source else "engine/attention/paged_attention.cpp",
        "kv_layout": args.kv_layout,
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results[args.label] = record
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out} ({args.label})")


if __name__ == "__main__":
    main()
