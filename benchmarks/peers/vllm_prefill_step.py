"""vLLM's side of benchmarks/prefill_step.py: the same measurement in vLLM's CPU build.

Runs inside the venv of benchmarks/peers/setup_vllm.sh (never imports tidegate):

    source .cache/peers/vllm-env.sh
    $PEER_VLLM_PYTHON benchmarks/peers/vllm_prefill_step.py --model DIR --lengths 128 512 \
        --repeats 9 --out vllm.json
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
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out.resolve()
    llm = offline_llm(args.model.resolve(), max(args.lengths) + 16, False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(length: int, seed: int) -> list[TokensPrompt]:
        # The same prompts as benchmarks/prefill_step.py makes (same seeds and vocabulary).
        rng = random.Random(seed)
        return [TokensPrompt(prompt_token_ids=[rng.randrange(6, vocab) for _ in range(length)])]

    result = {}
    for n in args.lengths:
        llm.generate(prompt(n, n), params, use_tqdm=False)
        samples = []
        for i in range(args.repeats):
            batch = prompt(n, n * 1000 + i)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            samples.append((time.perf_counter() - start) * 1000)
        result[str(n)] = statistics.median(samples)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
