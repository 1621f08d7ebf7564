"""`tidegate bench throughput`: offline generation throughput through `LLM`."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tidegate.engine.config import EngineArgs


def random_prompts(num_prompts: int, input_len: int, seed: int, high: int) -> list[list[int]]:
    """Token-id prompts of exactly `input_len` tokens, seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(10, high) for _ in range(input_len)] for _ in range(num_prompts)]


def measure(args: EngineArgs, prompts: list[list[int]], output_len: int) -> dict:
    """Warm up, then time one `generate` of every prompt (greedy, EOS ignored)."""
    from tidegate.engine import LLM, SamplingParams

    llm = LLM(**args.model_dump())
    # Warm up on reversed prompts: the same shapes, but nothing the prefix cache could reuse.
    llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "seconds": round(seconds, 4),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / seconds, 2),
        "total_tokens_per_s": round((generated + prompt_tokens) / seconds, 2),
        "requests_per_s": round(len(prompts) / seconds, 3),
    }


def main(ns: argparse.Namespace, args: EngineArgs) -> int:
    """Entry point of `tidegate bench throughput`."""
    from tidegate.engine.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    prompts = random_prompts(ns.num_prompts, ns.input_len, ns.seed, min(vocab, 1000))
    result = measure(args, prompts, ns.output_len)
    record = {
        "benchmark": "throughput",
        "config": {
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "num_prompts": ns.num_prompts,
            "seed": ns.seed,
            "engine_args": args.model_dump(exclude_defaults=True),
        },
        "result": result,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(text + "\n")
    return 0
