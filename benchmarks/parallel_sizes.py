"""What the parallel-size scenarios share: prompts, timed repeats, and the size comparison.

tensor_parallel.py and data_parallel.py each say how one size runs (offline `LLM`, or a
server); this module times the repeats, keeps the median, compares every size's outputs with
the first size's, prints the figures and writes the JSON record.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import RESULTS, machine, model_dir, write_result

# One size's run: (model folder, size, prompts, output_len, args) -> summary with "outputs".
SizeRun = Callable[[Path, int, list[list[int]], int, argparse.Namespace], dict[str, Any]]


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Random token ids (above the special tokens), the same for every size."""
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def timed_repeats(
    repeats: int,
    prompts: list[list[int]],
    vocab_size: int,
    generate: Callable[[list[list[int]]], tuple[Any, int]],
) -> tuple[dict[str, Any], Any]:
    """The median of `repeats` timed `generate(prompts) -> (outputs, generated tokens)`.

    Returns the median run's figures (and every run's output rate) with the last outputs.
    """
    runs, outputs = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        outputs, generated = generate(prompts)
        elapsed = time.perf_counter() - start
        runs.append(
            {
                "seconds": elapsed,
                "output_tokens_per_s": generated / elapsed,
                "total_tokens_per_s": (generated + sum(map(len, prompts))) / elapsed,
            }
        )
        # Each repeat computes the prompts afresh: nothing left in the prefix cache.
        prompts = [[p[0] + 1 if p[0] + 1 < vocab_size else 6, *p[1:]] for p in prompts]
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    summary = {
        **median,
        "all_output_tokens_per_s": [round(r["output_tokens_per_s"], 1) for r in runs],
    }
    return summary, outputs


def offline_parser(description: str) -> argparse.ArgumentParser:
    """The flags of an offline comparison: the workload, the dtype, the repeats, --smoke."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny model, seconds, for CI")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; median kept")
    return parser


def compare_sizes(name: str, kind: str, compared: str, run: SizeRun, description: str) -> None:
    """The scenario's command line: run each size, compare outputs, write results/NAME.json.

    `kind` labels the sizes ("tp", "dp"); `compared` names what `run` returns as "outputs"
    ("tokens", "texts").
    """
    parser = offline_parser(description)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help=f"{kind} sizes")
    args = parser.parse_args()
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 4, 16, 8, 1
    size = "tiny" if args.smoke else "small"
    model = model_dir(size)
    from tidegate.engine.model.config import ModelConfig

    args.vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(args.vocab, args.num_prompts, args.input_len, seed=0)
    results = {}
    for n in args.sizes:
        results[f"{kind}={n}"] = run(model, n, [list(p) for p in prompts], args.output_len, args)
    reference = results[f"{kind}={args.sizes[0]}"]["outputs"]
    for label, result in results.items():
        outputs = result.pop("outputs")
        result[f"{compared}_match_first_size"] = outputs == reference
        result["sequences_differing"] = sum(a != b for a, b in zip(outputs, reference, strict=True))
        print(
            f"{label}: {result['output_tokens_per_s']:.1f} output tok/s "
            f"({result['total_tokens_per_s']:.1f} total), startup {result['startup_s']} s, "
            f"{compared} match: {result[f'{compared}_match_first_size']}"
        )
    record = {
        "model": size,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "results": results,
        "machine": machine(),
    }
    print(f"wrote {write_result(name, record, args.out_dir)}")
