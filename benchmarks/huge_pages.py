"""Huge pages on and off: the same engine twice in one process, alternating round by round.

Two offline engines on one model folder, one with `cpu_huge_pages` (the weights and the KV
cache on transparent huge pages) and one without, take turns on fresh batches of two
workloads: embeddings (all prefill: 128 inputs of 32-512 tokens) and generation (32 prompts
of 256 tokens, 128 tokens out each, EOS ignored: mostly decode). Each round draws a new
batch, so that no round reuses another's cached prefixes, and both engines run the same
batch back to back, in alternating order; the median round's rate is kept. One process,
tcmalloc (the script starts itself again under it), so the host's drift falls on both
engines alike. Also records how much of each engine's weights and cache the kernel put on
huge pages.

    python benchmarks/huge_pages.py --out benchmarks/results/huge_pages.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from embeddings import make_inputs, on_tcmalloc
from offline_throughput import torch_machine, write_record


def engines(model_dir: Path, dtype: str, max_model_len: int) -> dict:
    """The two engines, loaded once, keyed by setting ("huge pages", "4 KiB pages")."""
    from tidegate.engine import LLM

    loaded = {}
    for name, huge in (("4 KiB pages", False), ("huge pages", True)):
        start = time.perf_counter()
        llm = LLM(
            model=str(model_dir), dtype=dtype, max_model_len=max_model_len, cpu_huge_pages=huge
        )
        loaded[name] = {"llm": llm, "load_s": round(time.perf_counter() - start, 2)}
    return loaded


def on_huge_pages(llm) -> dict:
    """MiB of the engine's weights and KV cache, and of huge pages in the memory mappings
    that hold them (a mapping malloc shares with other memory counts whole: for the 4 KiB
    engine, whose cache and weights sit in malloc's mappings, read it as an upper bound)."""
    from tidegate.engine import huge_pages

    runner = llm.engine.executor.worker.runner
    cache = [(t.data_ptr(), t.nbytes) for pair in runner.kv_caches for t in pair]
    weights = huge_pages.model_extents(runner.model)
    return {
        "weights_mib": round(sum(n for _, n in weights) / 2**20, 1),
        "huge_pages_in_weights_mappings_mib": round(huge_pages.huge_bytes_in(weights) / 2**20, 1),
        "kv_cache_mib": round(sum(n for _, n in cache) / 2**20, 1),
        "huge_pages_in_kv_cache_mappings_mib": round(huge_pages.huge_bytes_in(cache) / 2**20, 1),
    }


def embed_round(llm, batch) -> float:
    """Embedded tokens a second."""
    start = time.perf_counter()
    llm.embed(batch)
    return sum(map(len, batch)) / (time.perf_counter() - start)


def generate_round(llm, batch, output_len: int) -> float:
    """Generated tokens a second."""
    from tidegate.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / (time.perf_counter() - start)


def main() -> None:
    on_tcmalloc()
    # The runner's lines on what went onto huge pages go with the results.
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tidegate.engine.worker.model_runner").setLevel(logging.INFO)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="make-tiny-model's --size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per workload")
    parser.add_argument("--embed-inputs", type=int, default=128)
    parser.add_argument("--embed-len", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tidegate.engine.tiny_model import make_tiny_model

    loads = [os.getloadavg()[0]]
    rates: dict[str, dict[str, list[float]]] = {"embed": {}, "generate": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / args.size, arch="llama", size=args.size, seed=0)
        vocab = min(4000, json.loads((model_dir / "config.json").read_text())["vocab_size"])
        max_model_len = max(args.embed_len[1], args.input_len + args.output_len) + 16
        loaded = engines(model_dir, args.dtype, max_model_len)
        names = list(loaded)
        for entry in loaded.values():  # warm-up: shapes, not anything the cache reuses
            entry["llm"].embed(make_inputs(vocab, 2, *args.embed_len, seed=10_000))
        for round_index in range(args.repeats):
            seed = args.repeats * 7 + round_index
            embed_batch = make_inputs(vocab, args.embed_inputs, *args.embed_len, seed=seed)
            prompt_batch = make_inputs(vocab, args.prompts, args.input_len, args.input_len, seed)
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                llm = loaded[name]["llm"]
                rates["embed"].setdefault(name, []).append(embed_round(llm, embed_batch))
                rate = generate_round(llm, prompt_batch, args.output_len)
                rates["generate"].setdefault(name, []).append(rate)
            loads.append(os.getloadavg()[0])
        pages = {name: on_huge_pages(entry["llm"]) for name, entry in loaded.items()}
        for entry in loaded.values():
            entry["llm"].close()

    results: dict = {}
    for workload, by_engine in rates.items():
        medians = {name: statistics.median(values) for name, values in by_engine.items()}
        results[workload] = {
            name: {"tokens_per_s": round(medians[name], 1), "rounds": [round(v, 1) for v in values]}
            for name, values in by_engine.items()
        }
        results[workload]["huge_over_4k"] = round(medians["huge pages"] / medians["4 KiB pages"], 3)
    from tidegate.engine import huge_pages
    from tidegate.engine.allocator import allocator_in_use

    record = {
        "benchmark": "huge_pages",
        "model": f"tiny-model --size {args.size} (llama)",
        "workload": {
            "embed": {"inputs": args.embed_inputs, "input_len": args.embed_len},
            "generate": {
                "prompts": args.prompts,
                "input_len": args.input_len,
                "output_len": args.output_len,
            },
            "dtype": args.dtype,
            "repeats": args.repeats,
        },
        "machine": {
            **torch_machine(loads),
            "allocator": allocator_in_use(),
            "thp_mode": huge_pages.thp_mode(),
        },
        "load_s": {name: entry["load_s"] for name, entry in loaded.items()},
        "memory": pages,
        "results": results,
    }
    write_record(args.out, record)
    print(json.dumps({"results": results, "memory": pages}, indent=2))


if __name__ == "__main__":
    main()
