"""cuda_graphs: decode steps with and without CUDA graphs (compilation level 2), on a GPU.

For each level in --levels (0 eager, 1 torch.compile, 2 compile plus decode graphs), a fresh
engine on the tiny model (bf16, Triton attention):

1. parity, in float32: greedy tokens for prompts of 1 to ~200 tokens (chunked, mixed with
   decodes, prefix hits, batches shrinking as requests finish) must equal level 0's, or it
   stops. (In bf16, fused kernels round differently, and a random tiny model's near-tied
   logits flip: bf16 tokens are not expected to match.)
2. decode step time, in --dtype (bf16): B requests of 16 tokens each generate 128; every
   worker step that is decode-only is timed (the whole step: inputs, forward, sampling),
   median kept, for each B, with the median time from one decode-only step's end to the
   next's (what a stream sees per token: with async scheduling the engine plans the next
   step while this one runs, so that can be less than a step plus the planning).

    python benchmarks/cuda_graphs.py --out benchmarks/results/cuda_graphs.json
    python benchmarks/cuda_graphs.py --async-scheduling --out .../cuda_graphs_async.json

With --async-scheduling every engine plans step N+1 while step N runs (graphs replayed while
the next step's inputs are prepared), and the parity reference is a synchronous level-0
engine: async scheduling must give the same float32 greedy tokens at every level.
`--device cpu --levels 0 1` runs the same script without a GPU (no graphs), to check it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from common import machine, model_dir
from tidegate.engine import LLM, SamplingParams

BATCH_SIZES = (1, 8, 32, 128)
OUTPUT_LEN = 128


def parity_prompts() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    shared = [rng.randrange(10, 900) for _ in range(48)]
    prompts = [[rng.randrange(10, 900) for _ in range(1 + 23 * i)] for i in range(9)]
    prompts += [[*shared, *(rng.randrange(10, 900) for _ in range(5 + i))] for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 7), ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


def timed_steps(llm: LLM) -> list[tuple[float, float]]:
    """Wrap the worker's step so that every decode-only step's (start, end) is recorded."""
    runner = llm.engine.executor.worker.runner
    execute, times = runner.execute_model, []

    def timed(so):
        start = time.perf_counter()
        out = execute(so)  # ends in .tolist(): the GPU is done when it returns
        if so.num_scheduled_tokens and all(n == 1 for n in so.num_scheduled_tokens.values()):
            times.append((start, time.perf_counter()))
        return out

    runner.execute_model = timed
    return times


def step_figures(times: list[tuple[float, float]]) -> dict:
    """Median and p90 of the decode-only steps' own times, and the median from one's end to
    the next's."""
    seconds = [end - start for start, end in times]
    intervals = [b[1] - a[1] for a, b in itertools.pairwise(times)]

    def ms(value: float) -> float:
        return round(1000 * value, 4)

    return {
        "decode_steps": len(times),
        "median_ms": ms(statistics.median(seconds)),
        "p90_ms": ms(statistics.quantiles(seconds, n=10)[-1]) if len(seconds) > 1 else None,
        "median_interval_ms": ms(statistics.median(intervals)) if intervals else None,
    }


def engine(
    ns: argparse.Namespace, model: Path, level: int, dtype: str, async_scheduling: bool
) -> LLM:
    return LLM(
        model=str(model),
        dtype=dtype,
        device=ns.device,
        attention_backend="triton" if ns.device == "cuda" else "torch",
        compilation_level=level,
        async_scheduling=async_scheduling,
        max_num_seqs=max(ns.batch_sizes),
        num_gpu_blocks=4096,
        max_model_len=1024,
    )


def free(llm: LLM, device: str) -> None:
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def parity_tokens(ns: argparse.Namespace, model: Path, level: int, async_scheduling: bool):
    """float32 greedy tokens of the parity prompts."""
    llm = engine(ns, model, level, "float32", async_scheduling)
    prompts, params = parity_prompts()
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    free(llm, ns.device)
    return tokens


def run_level(ns: argparse.Namespace, model: Path, level: int) -> dict:
    tokens = parity_tokens(ns, model, level, ns.async_scheduling)
    start = time.perf_counter()
    llm = engine(ns, model, level, ns.dtype, ns.async_scheduling)
    startup = time.perf_counter() - start
    runner = llm.engine.executor.worker.runner
    times = timed_steps(llm)
    rng = random.Random(1)
    steps = {}
    for batch in ns.batch_sizes:
        times.clear()
        batch_prompts = [[rng.randrange(10, 900) for _ in range(16)] for _ in range(batch)]
        decode = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
        llm.generate(batch_prompts, decode)
        steps[str(batch)] = step_figures(times)
    graphs = runner.decode_graphs
    record = {
        "level": runner.compilation_level,
        "startup_s": round(startup, 2),
        "captured_sizes": graphs.sizes if graphs else [],
        "replays": sum(graphs.replays.values()) if graphs else 0,
        "decode_step": steps,
    }
    del runner
    free(llm, ns.device)
    return record | {"tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --device cpu --levels 0 1")
    model = model_dir("tiny")
    levels = {}
    for level in ns.levels:
        levels[level] = run_level(ns, model, level)
        print(f"level {level}:", json.dumps(levels[level]["decode_step"]), file=sys.stderr)
    if ns.async_scheduling:
        reference, against = parity_tokens(ns, model, 0, False), "synchronous level 0"
    else:
        reference, against = levels[ns.levels[0]]["tokens"], f"level {ns.levels[0]}"
    for level in ns.levels:
        if levels[level].pop("tokens") != reference:
            raise SystemExit(f"level {level}'s greedy tokens differ from {against}'s")
    first = str(ns.levels[0])
    scheduling = "async scheduling" if ns.async_scheduling else "synchronous scheduling"
    record = {
        "benchmark": "cuda_graphs",
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "machine": machine(),
        "scheduling": scheduling,
        "parity": f"float32 greedy tokens of levels {ns.levels} with {scheduling} equal "
        f"{against}'s",
        "levels": {str(k): v for k, v in levels.items()},
        f"median_decode_step_over_level_{first}": {
            str(level): {
                b: round(
                    levels[level]["decode_step"][b]["median_ms"]
                    / levels[ns.levels[0]]["decode_step"][b]["median_ms"],
                    3,
                )
                for b in map(str, ns.batch_sizes)
            }
            for level in ns.levels[1:]
        },
    }
    text = json.dumps(record, indent=2)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
