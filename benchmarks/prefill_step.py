"""prefill-step: the time of one offline prefill of a fresh prompt, Tidegate next to vLLM.

For each prompt length, `LLM.generate` runs one prompt of random token ids with max_tokens=1
(prefix caching off, so every prompt is computed whole), `--repeats` times with a fresh prompt
each time; reported is the median wall time of the call, in ms: the prefill step, the LM
head and sampling of one token, and the offline engine's own overhead. It is the compute
part of a lone request's time to first token. `--with-vllm` runs the same in vLLM's CPU
build (make bench-peers), at its default compilation, through
benchmarks/peers/vllm_prefill_step.py; the two runs alternate `--rounds` times.

    python benchmarks/prefill_step.py --with-vllm   # writes results/prefill_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from offline_throughput import make_prompts

from common import machine, model_dir, run_peer_script

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_prefill_step.py"


def prefill_ms(generate, vocab: int, length: int, repeats: int) -> float:
    """Median ms of generate(one fresh prompt of `length` tokens, max_tokens=1)."""
    generate(make_prompts(vocab, 1, length, seed=length))  # shapes warm
    samples = []
    for i in range(repeats):
        prompt = make_prompts(vocab, 1, length, seed=length * 1000 + i)
        start = time.perf_counter()
        generate(prompt)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def run_tidegate(folder: Path, lengths, repeats: int) -> dict:
    from tidegate.engine import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="bfloat16", enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return {
        str(n): prefill_ms(lambda p: llm.generate(p, params), vocab, n, repeats) for n in lengths
    }


def run_vllm(folder: Path, lengths, repeats: int) -> dict:
    arguments = ["--model", str(folder), "--lengths", *map(str, lengths)]
    return run_peer_script(PEER_SCRIPT, [*arguments, "--repeats", str(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 320, 512, 1024])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs; medians kept")
    parser.add_argument("--with-vllm", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/prefill_step.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = model_dir(args.size)
    if args.child:
        print(json.dumps(run_tidegate(folder, args.lengths, args.repeats)))
        return
    runs: dict[str, list[dict]] = {"tidegate": [], "vllm": []}
    loads = [round(os.getloadavg()[0], 2)]
    for _ in range(args.rounds):
        runs["tidegate"].append(run_in_subprocess(args.lengths, args.repeats, args.size))
        if args.with_vllm:
            runs["vllm"].append(run_vllm(folder, args.lengths, args.repeats))
        loads.append(round(os.getloadavg()[0], 2))
    record = {
        "benchmark": "prefill_step",
        "command": "python benchmarks/prefill_step.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "model": args.size,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "load_average_1m": loads,
        "tidegate_ms": median_of_rounds(runs["tidegate"]),
        "tidegate_rounds": runs["tidegate"],
    }
    if args.with_vllm:
        record["vllm_ms"] = median_of_rounds(runs["vllm"])
        record["vllm_rounds"] = runs["vllm"]
        record["tidegate_over_vllm"] = {
            n: round(t / record["vllm_ms"][n], 3) for n, t in record["tidegate_ms"].items()
        }
    print(json.dumps(record, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


def median_of_rounds(rounds: list[dict]) -> dict:
    return {n: round(statistics.median(r[n] for r in rounds), 2) for n in rounds[0]}


def run_in_subprocess(lengths, repeats: int, size: str) -> dict:
    """run_tidegate in a child process: each round starts its engine afresh, as vLLM's does."""
    command = [sys.executable, __file__, "--child", "--size", size, "--repeats", str(repeats)]
    command += ["--lengths", *map(str, lengths)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
