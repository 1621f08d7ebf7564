"""vLLM's side of benchmarks/decode_step.py: the same measurement in vLLM's CPU build.

Runs inside the venv of benchmarks/peers/setup_vllm.sh (never imports tidegate):

    source .cache/peers/vllm-env.sh
    $PEER_VLLM_PYTHON benchmarks/peers/vllm_decode_step.py --model DIR --sizes 1 8 \
        --context 600 --steps 64 --repeats 3 --out vllm.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_common import offline_llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out.resolve()
    llm = offline_llm(args.model.resolve(), args.context + args.steps + 16, True)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
        llm.generate(batch, params, use_tqdm=False)

    result = {}
    for n in args.sizes:
        # The same prompts as benchmarks/decode_step.py makes (same seed and vocabulary).
        rng = random.Random(n)
        prompts = [[rng.randrange(6, vocab) for _ in range(args.context)] for _ in range(n)]
        generate(prompts, 1)
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            generate(prompts, 1)
            one = time.perf_counter() - start
            start = time.perf_counter()
            generate(prompts, 1 + args.steps)
            many = time.perf_counter() - start
            samples.append((many - one) / args.steps * 1000)
        result[str(n)] = statistics.median(samples)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
