"""Compiled vs eager: offline throughput at compilation levels 0 and 1, and start-up times.

Three variants: eager, level 1, and eager with the bf16 linear weights left unpacked
(engine/model/packed_linear.py), which shows what packing them for oneDNN gains. Every run is
a fresh process (so no variant inherits another's compiled code), variants alternate so that
load from other work on the machine hits all alike, and the median run of each is kept. All
level-1 runs of a model share one compile cache directory: the first is a cold start, the
later ones show what the cache saves.

    .venv/bin/python benchmarks/compile.py --out benchmarks/results/compile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, machine, model_dir


def child(ns: argparse.Namespace) -> None:
    """One measurement in this process: start-up (with warm-up), then throughput."""
    from tidegate.engine.bench.throughput import measure, random_prompts
    from tidegate.engine.config import EngineArgs
    from tidegate.engine.llm import LLM

    if ns.unpacked:
        from tidegate.engine.worker import model_runner

        model_runner.pack_linear_weights = lambda model, **plan: 0  # nothing packed

    args = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        compilation_level=ns.level,
        compile_cache_dir=ns.cache_dir,
    )
    start = time.perf_counter()
    llm = LLM(**args.model_dump())
    startup = time.perf_counter() - start
    runner = llm.engine.executor.worker.runner
    # Throughput on a second engine would compile again: measure() builds its own, so time
    # start-up here and hand measure() this process's already compiled code (same model).
    graphs = runner.compiler.num_graphs
    del llm
    prompts = random_prompts(ns.num_prompts, ns.input_len, ns.seed, 1000)
    result = measure(args, prompts, ns.output_len)
    result.update(startup_s=round(startup, 2), graphs_at_startup=graphs)
    print(json.dumps(result))


# name: (compilation level, linear weights packed)
VARIANTS = {"0": (0, True), "1": (1, True), "0-unpacked": (0, False)}


def run_child(ns: argparse.Namespace, model: Path, variant: str, cache_dir: str) -> dict:
    level, packed = VARIANTS[variant]
    command = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        str(model),
        "--level",
        str(level),
        "--cache-dir",
        cache_dir,
        "--dtype",
        ns.dtype,
        "--num-prompts",
        str(ns.num_prompts),
        "--input-len",
        str(ns.input_len),
        "--output-len",
        str(ns.output_len),
        *([] if packed else ["--unpacked"]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pairs_faster(runs: list[dict], than: list[dict]) -> int:
    """In how many repeats `runs` beat `than` (runs alternate: repeat i saw one machine)."""
    return sum(
        a["output_tokens_per_s"] > b["output_tokens_per_s"] for a, b in zip(runs, than, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3, help="runs per level; median kept")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    # Internal: one measurement in a fresh process.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--level", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--unpacked", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(ns)
        return

    results = []
    for size in ns.sizes:
        model = model_dir(size)
        runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
        with tempfile.TemporaryDirectory(prefix="tidegate-compile-cache-") as cache_dir:
            for _ in range(ns.repeats):
                for variant in VARIANTS:
                    run = run_child(ns, model, variant, cache_dir)
                    print(size, variant, json.dumps(run), file=sys.stderr, flush=True)
                    runs[variant].append(run)
        eager = statistics.median(r["output_tokens_per_s"] for r in runs["0"])
        compiled = statistics.median(r["output_tokens_per_s"] for r in runs["1"])
        unpacked = statistics.median(r["output_tokens_per_s"] for r in runs["0-unpacked"])
        cold, *warm = (r["startup_s"] for r in runs["1"])
        results.append(
            {
                "model": f"tidegate make-tiny-model --size {size} (llama)",
                "eager_output_tokens_per_s": eager,
                "level1_output_tokens_per_s": compiled,
                "level1_over_eager": round(compiled / eager, 3),
                # Runs alternate, so run i of each level saw much the same machine.
                "pairs_level1_faster": pairs_faster(runs["1"], runs["0"]),
                "eager_unpacked_output_tokens_per_s": unpacked,
                "packed_over_unpacked": round(eager / unpacked, 3),
                "pairs_packed_faster": pairs_faster(runs["0"], runs["0-unpacked"]),
                "eager_startup_s": statistics.median(r["startup_s"] for r in runs["0"]),
                "level1_startup_s_cold_cache": cold,
                "level1_startup_s_warm_cache": statistics.median(warm) if warm else None,
                "level1_graphs_at_startup": runs["1"][0]["graphs_at_startup"],
                "runs": runs,
            }
        )
    record = {
        "benchmark": "compile",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": machine(),
        "workload": {
            "num_prompts": ns.num_prompts,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "dtype": ns.dtype,
            "greedy": True,
            "repeats": ns.repeats,
        },
        "results": results,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
