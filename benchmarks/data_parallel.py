"""data-parallel: serving throughput of one engine core against M, behind one API server.

Same model folder, same prompts (random token ids, fixed seed, no shared prefix), greedy, EOS
ignored, all requests sent at once to `tidegate serve --data-parallel-size-local M`. On CPU
the cores of the machine are split between the engine cores (each worker takes
cores / (M * TP) threads), so DP trades threads per step for parallel steps; the greedy
tokens of every size are compared with the first size's.

    python benchmarks/data_parallel.py           # small model, writes results/data_parallel.json
    python benchmarks/data_parallel.py --smoke   # tiny model, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import httpx
from common import RESULTS, machine, model_dir, write_result

from tidegate.engine.bench.local_server import LocalServer, free_port, serve_command


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


async def _send_all(base_url: str, prompts: list[list[int]], output_len: int) -> list[list[str]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(prompt: list[int]) -> list[str]:
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(p) for p in prompts))


def run(model: Path, dp: int, prompts: list[list[int]], output_len: int, args) -> dict:
    """The median of `repeats` timed bursts against a server with `dp` engine cores."""
    port = free_port()
    flags = ["--dtype", args.dtype, "--served-model-name", "m", "--log-level", "warning"]
    command = serve_command(model, *flags, "--data-parallel-size-local", str(dp), port=port)
    server = LocalServer(command, port)
    runs, texts = [], []
    try:
        started = time.perf_counter()
        server.wait_healthy(300)
        startup_s = time.perf_counter() - started
        # Warm up on reversed prompts: the same shapes, nothing the prefix cache could reuse.
        asyncio.run(_send_all(server.base_url, [p[::-1] for p in prompts[: 2 * dp]], 4))
        for _ in range(args.repeats):
            start = time.perf_counter()
            texts = asyncio.run(_send_all(server.base_url, prompts, output_len))
            elapsed = time.perf_counter() - start
            generated = len(prompts) * output_len
            runs.append(
                {
                    "seconds": elapsed,
                    "output_tokens_per_s": generated / elapsed,
                    "total_tokens_per_s": (generated + sum(map(len, prompts))) / elapsed,
                }
            )
            # Each repeat computes the prompts afresh: nothing left in the prefix cache.
            prompts = [[p[0] + 1 if p[0] + 1 < args.vocab else 6, *p[1:]] for p in prompts]
    finally:
        server.stop()
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {
        **median,
        "startup_s": round(startup_s, 2),
        "all_output_tokens_per_s": [round(r["output_tokens_per_s"], 1) for r in runs],
        "texts": texts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, seconds, for CI")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="DP sizes")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per size; median kept")
    args = parser.parse_args()
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 4, 16, 8, 1
    size = "tiny" if args.smoke else "small"
    model = model_dir(size)
    from tidegate.engine.model.config import ModelConfig

    args.vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(args.vocab, args.num_prompts, args.input_len, seed=0)
    results = {}
    for dp in args.sizes:
        results[f"dp={dp}"] = run(model, dp, [list(p) for p in prompts], args.output_len, args)
    reference = results[f"dp={args.sizes[0]}"]["texts"]
    for label, result in results.items():
        texts = result.pop("texts")
        result["texts_match_first_size"] = texts == reference
        result["sequences_differing"] = sum(a != b for a, b in zip(texts, reference, strict=True))
        print(
            f"{label}: {result['output_tokens_per_s']:.1f} output tok/s "
            f"({result['total_tokens_per_s']:.1f} total), startup {result['startup_s']} s, "
            f"texts match: {result['texts_match_first_size']}"
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
    path = write_result("data_parallel", record, args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
