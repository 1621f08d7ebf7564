"""tensor-parallel: offline throughput of one worker against N worker processes, in one run.

Same model folder, same prompts (random token ids, fixed seed), greedy, EOS ignored. Each
size runs `LLM(tensor_parallel_size=N).generate` `--repeats` times; the median run is kept,
and the tokens of every size are compared with one worker's. On CPU the ranks share the
machine's cores (each takes cores / N threads), so TP buys memory per rank, not speed,
unless the cores outnumber what one process can use.

    python benchmarks/tensor_parallel.py           # small model, writes results/tensor_parallel.json
    python benchmarks/tensor_parallel.py --smoke   # tiny model, seconds
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from common import RESULTS, machine, model_dir, write_result


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run(model: Path, tp: int, prompts: list[list[int]], output_len: int, args) -> dict:
    """The median of `repeats` timed generate calls with `tp` ranks, and its tokens."""
    from tidegate.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    runs = []
    started = time.perf_counter()
    with LLM(model=str(model), dtype=args.dtype, tensor_parallel_size=tp) as llm:
        startup_s = time.perf_counter() - started
        # Warm up on reversed prompts: the same shapes, nothing the prefix cache could reuse.
        llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs.append(
                {
                    "seconds": elapsed,
                    "output_tokens_per_s": generated / elapsed,
                    "total_tokens_per_s": (generated + sum(map(len, prompts))) / elapsed,
                }
            )
            # Each repeat computes the prompts afresh: drop what the prefix cache holds.
            prompts = [[p[0] + 1 if p[0] + 1 < args.vocab else 6, *p[1:]] for p in prompts]
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {
        **median,
        "startup_s": round(startup_s, 2),
        "all_output_tokens_per_s": [round(r["output_tokens_per_s"], 1) for r in runs],
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, seconds, for CI")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="TP sizes")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; median kept")
    args = parser.parse_args()
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 4, 16, 8, 1
    size = "tiny" if args.smoke else "small"
    model = model_dir(size)
    from tidegate.engine.model.config import ModelConfig

    args.vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(args.vocab, args.num_prompts, args.input_len, seed=0)
    results = {}
    for tp in args.sizes:
        results[f"tp={tp}"] = run(model, tp, [list(p) for p in prompts], args.output_len, args)
    reference = results[f"tp={args.sizes[0]}"]["tokens"]
    for label, result in results.items():
        tokens = result.pop("tokens")
        result["tokens_match_first_size"] = tokens == reference
        result["sequences_differing"] = sum(a != b for a, b in zip(tokens, reference, strict=True))
        print(
            f"{label}: {result['output_tokens_per_s']:.1f} output tok/s "
            f"({result['total_tokens_per_s']:.1f} total), startup {result['startup_s']} s, "
            f"tokens match: {result['tokens_match_first_size']}"
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
    path = write_result("tensor_parallel", record, args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
