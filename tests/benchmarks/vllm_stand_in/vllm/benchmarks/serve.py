"""Stand-in for `vllm.benchmarks.serve`: its flags and saved result, our client's load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import random_workload


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags benchmarks/independent_check.py passes."""
    for flag in ("--backend", "--base-url", "--endpoint", "--model", "--tokenizer"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--dataset-name", choices=["random"], required=True)
    parser.add_argument("--random-input-len", type=int, required=True)
    parser.add_argument("--random-range-ratio", type=float, required=True)
    parser.add_argument("--random-output-len", type=int, required=True)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--request-rate", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--percentile-metrics", required=True)
    parser.add_argument("--metric-percentiles", required=True)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--result-filename", required=True)
    parser.add_argument("--disable-tqdm", action="store_true")


def main(args: argparse.Namespace) -> None:
    """One run, saved under vLLM's names for the figures the check reads."""
    ratio, length = args.random_range_ratio, args.random_input_len
    input_len = (round(length * (1 - ratio)), round(length * (1 + ratio)))
    output_len = (args.random_output_len, args.random_output_len)
    workload = random_workload(args.num_prompts, input_len, output_len, seed=args.seed)
    result, _ = run_bench(
        args.base_url, args.model, workload, request_rate=args.request_rate, progress=False
    )
    saved = {
        "completed": result["completed"],
        "output_throughput": result["output_token_throughput"],
        "median_ttft_ms": result["ttft_ms"]["p50"],
        "median_tpot_ms": result["tpot_ms"]["p50"],
        "median_itl_ms": result["itl_ms"]["p50"],
        "p99_itl_ms": result["itl_ms"]["p99"],
    }
    (args.result_dir / args.result_filename).write_text(json.dumps(saved))
