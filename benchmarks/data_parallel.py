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

import asyncio
import time
from pathlib import Path

import httpx
from parallel_sizes import compare_sizes, timed_repeats

from tidegate.common.local_server import LocalServer, free_port, serve_command


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
    try:
        started = time.perf_counter()
        server.wait_healthy(300)
        startup_s = time.perf_counter() - started
        # Warm up on reversed prompts: the same shapes, nothing the prefix cache could reuse.
        asyncio.run(_send_all(server.base_url, [p[::-1] for p in prompts[: 2 * dp]], 4))

        def generate(batch: list[list[int]]) -> tuple[list[str], int]:
            texts = asyncio.run(_send_all(server.base_url, batch, output_len))
            return texts, len(batch) * output_len  # ignore_eos: every request runs to the end

        summary, texts = timed_repeats(args.repeats, prompts, args.vocab, generate)
    finally:
        server.stop()
    return {**summary, "startup_s": round(startup_s, 2), "outputs": texts}


def main() -> None:
    compare_sizes("data_parallel", "dp", "texts", run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
