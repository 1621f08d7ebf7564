"""Write the benchmark's prompts (random token ids) as JSON, for engines that run in other venvs.

The same rule as benchmarks/offline_throughput.py (ids in [6, min(vocab, 4000)), seeded), so
a peer given this file sees exactly the prompts Tidegate and transformers saw. Standard
library only: it runs under any Python.

    python benchmarks/peers/make_prompts.py --model DIR --out prompts.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FIRST_ID = 6  # after the special tokens <pad> <s> </s> <|system|> <|user|> <|assistant|>
ID_CAP = 4000  # as offline_throughput.py: the small model's tokenizer stops near 3,967 tokens


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """The prompts offline_throughput.py draws for the same arguments."""
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ID, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="folder with config.json")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(min(vocab, ID_CAP), args.num_prompts, args.input_len, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(prompts) + "\n")
    print(f"{args.out}: {len(prompts)} prompts x {args.input_len} token ids")


if __name__ == "__main__":
    main()
