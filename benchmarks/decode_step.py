"""decode-step: the time of one offline decode step at 1-32 sequences, Tidegate next to vLLM.

Each size runs `LLM.generate` twice on the same prompts of `--context` random token ids:
with max_tokens=1 and with 1 + `--steps`. The prompts are in the prefix cache by then, so
both runs do the same (small) prefill, and the difference divided by `--steps` is the time
of a decode step of that many sequences. Medians of `--repeats` alternating pairs; greedy,
EOS ignored. `--with-vllm` runs the same in vLLM's CPU build (make bench-peers), at its
default compilation, through benchmarks/peers/vllm_decode_step.py.

    python benchmarks/decode_step.py --with-vllm   # writes results/decode_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from offline_throughput import make_prompts

from common import machine, model_dir, run_peer_script

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_decode_step.py"


def step_ms(generate, prompts, steps: int, repeats: int) -> float:
    """Median over `repeats` of (time of 1 + steps tokens - time of 1 token) / steps, in ms."""
    generate(prompts, 1)  # fills the prefix cache
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(prompts, 1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        generate(prompts, 1 + steps)
        many = time.perf_counter() - start
        samples.append((many - one) / steps * 1000)
    return statistics.median(samples)


def run_tidegate(model_dir: Path, sizes, context: int, steps: int, repeats: int) -> dict:
    from tidegate.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="bfloat16")
    vocab = llm.engine.model_config.vocab_size

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params)

    return {
        str(n): step_ms(generate, make_prompts(vocab, n, context, seed=n), steps, repeats)
        for n in sizes
    }


def run_vllm(model_dir: Path, sizes, context: int, steps: int, repeats: int) -> dict:
    arguments = ["--model", str(model_dir), "--sizes", *map(str, sizes), "--context", str(context)]
    return run_peer_script(
        PEER_SCRIPT, [*arguments, "--steps", str(steps), "--repeats", str(repeats)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--with-vllm", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/decode_step.json")
    args = parser.parse_args()
    folder = model_dir(args.size)
    record = {
        "benchmark": "decode_step",
        "machine": machine(),
        "model": args.size,
        "context": args.context,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "tidegate_ms": run_tidegate(folder, args.sizes, args.context, args.steps, args.repeats),
    }
    if args.with_vllm:
        record["vllm_ms"] = run_vllm(folder, args.sizes, args.context, args.steps, args.repeats)
        record["tidegate_over_vllm"] = {
            n: round(t / record["vllm_ms"][n], 3) for n, t in record["tidegate_ms"].items()
        }
    record["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(record, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
