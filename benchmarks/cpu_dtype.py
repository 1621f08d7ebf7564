"""--dtype auto on this CPU: offline throughput of a bf16 checkpoint in bf16 and as auto runs it.

On a CPU without bf16 dot products auto runs a bf16 checkpoint in float32
(engine/model/dtypes.py); elsewhere the two runs are the same dtype. The small Llama (a bf16
checkpoint), 64 prompts of 128 random tokens, 64 greedy tokens each (EOS ignored), eager;
the two alternate, median of --repeats. Also times one bf16 and one fp32 matmul of the small
model's MLP shape. Writes a JSON record.

    python benchmarks/cpu_dtype.py --out benchmarks/results/cpu_dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from offline_throughput import make_prompts, median_run, run_tidegate


def matmul_gflops(dtype: torch.dtype, rows: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of x [rows, 768] @ W.T [768, 2048] in `dtype` through F.linear."""
    x, w = torch.randn(rows, 768).to(dtype), torch.randn(2048, 768).to(dtype)
    for _ in range(2):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * rows * 768 * 2048 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tidegate.engine.model.config import ModelConfig
    from tidegate.engine.model.dtypes import NATIVE_FLAGS, auto_dtype, cpu_x86_flags
    from tidegate.engine.tiny_model import make_tiny_model

    flags = cpu_x86_flags()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / args.size, arch="llama", size=args.size)
        config = ModelConfig.from_pretrained(model)
        picked, why = auto_dtype(config.torch_dtype, "cpu", 0, 0)
        prompts = make_prompts(config.vocab_size, args.num_prompts, args.input_len, 0)
        loads = [os.getloadavg()[0]]
        runs: dict[str, list[dict]] = {"bfloat16": [], "auto": []}
        for _ in range(args.repeats):
            for dtype in runs:
                runs[dtype].append(run_tidegate(model, prompts, args.output_len, dtype, level=0))
                loads.append(os.getloadavg()[0])
    bf16, auto = median_run(runs["bfloat16"]), median_run(runs["auto"])
    record = {
        "benchmark": "cpu_dtype",
        "model": f"tiny-model --size {args.size} (llama, {config.torch_dtype} checkpoint)",
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "greedy": True,
            "repeats": args.repeats,
            "compilation_level": 0,
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "native_16bit_flags": sorted(
                f for fs in NATIVE_FLAGS.values() for f in fs if f in flags
            ),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_1m": [round(load, 2) for load in loads],
        },
        "auto_picks": picked,
        "auto_reason": why,
        "matmul_gflops_2048x768x2048": {
            "bfloat16": round(matmul_gflops(torch.bfloat16), 1),
            "float32": round(matmul_gflops(torch.float32), 1),
        },
        "bfloat16": bf16,
        "auto": auto,
        "auto_over_bfloat16": auto["output_tokens_per_s"] / bf16["output_tokens_per_s"],
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
