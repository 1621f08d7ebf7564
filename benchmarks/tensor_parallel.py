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

import time
from pathlib import Path

from parallel_sizes import compare_sizes, timed_repeats


def run(model: Path, tp: int, prompts: list[list[int]], output_len: int, args) -> dict:
    """The median of `repeats` timed generate calls with `tp` ranks, and its tokens."""
    from tidegate.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    with LLM(model=str(model), dtype=args.dtype, tensor_parallel_size=tp) as llm:
        startup_s = time.perf_counter() - started
        # Warm up on reversed prompts: the same shapes, nothing the prefix cache could reuse.
        llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))

        def generate(batch: list[list[int]]) -> tuple[list[list[int]], int]:
            tokens = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
            return tokens, sum(map(len, tokens))

        summary, tokens = timed_repeats(args.repeats, prompts, args.vocab, generate)
    return {**summary, "startup_s": round(startup_s, 2), "outputs": tokens}


def main() -> None:
    compare_sizes("tensor_parallel", "tp", "tokens", run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
