"""Speculative decoding (prompt lookup): output tokens/s with and without it, by how often its
guesses are right, at 1, 4 and 16 requests at once.

A random-weight model never copies its prompt, so how often guesses are right is set by the
workload instead: greedy outputs restricted by allowed_token_ids to one token (`copy`: every
guess right, the upper bound), to three (`cycle`: the output falls into short cycles and
some guesses are right), or not at all (`open`: guesses are almost never made, which
measures what looking for them costs). Every step still runs the whole model and the full
vocabulary's logits. `--workloads json` runs structured output instead: an array of 8
objects with the same keys, the guesses cut to what the grammar takes. The small Llama at the dtype auto picks, 128 random prompt tokens and 128
output tokens per request, default compilation; the two engines alternate, median of
--repeats. Writes a JSON record.

    python benchmarks/spec_decode.py --out benchmarks/results/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts, torch_machine, write_record

WORKLOADS = {"copy": [7], "cycle": [7, 8, 9], "open": None, "json": None}
# `json`: structured output, an array of 8 objects with the same two keys, which prompt lookup
# guesses from the objects before (the random model fills in whitespace and values).
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "minItems": 8,
    "maxItems": 8,
}


def run(llm, prompts, output_len: int, workload: str) -> dict:
    from tidegate.engine import SamplingParams
    from tidegate.engine.sampling_params import StructuredOutputsParams

    if workload == "json":
        constraint = StructuredOutputsParams(json=json.dumps(ITEMS))
        params = SamplingParams(temperature=0, max_tokens=output_len, structured_outputs=constraint)
    else:
        params = SamplingParams(
            temperature=0,
            max_tokens=output_len,
            ignore_eos=True,
            allowed_token_ids=WORKLOADS[workload],
        )
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "steps": after["num_steps"] - before["num_steps"],
        "draft_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def median(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["seconds"])
    middle = {k: v for k, v in ordered[len(ordered) // 2].items() if k != "outputs"}
    middle["all_output_tokens_per_s"] = [round(r["output_tokens_per_s"], 1) for r in runs]
    return middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--workloads", nargs="+", default=["copy", "cycle", "open"], choices=WORKLOADS
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compilation-level", type=int, choices=[0, 1], default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tidegate.engine import LLM, SamplingParams
    from tidegate.engine.model.config import ModelConfig
    from tidegate.engine.tiny_model import make_tiny_model

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    results: dict[str, dict] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / args.size, arch="llama", size=args.size)
        config = ModelConfig.from_pretrained(model)
        engines = {
            "off": LLM(str(model), compilation_level=args.compilation_level),
            "ngram": LLM(
                str(model), compilation_level=args.compilation_level, speculative_config=spec
            ),
        }
        dtype = str(engines["off"].engine.args.dtype)
        for llm in engines.values():  # compile, and run the guessing path once, untimed
            llm.generate(
                make_prompts(config.vocab_size, 2, args.input_len, 99),
                SamplingParams(temperature=0, max_tokens=16, allowed_token_ids=[7]),
            )
        for workload in args.workloads:
            for concurrency in args.concurrency:
                runs: dict[str, list[dict]] = {name: [] for name in engines}
                for repeat in range(args.repeats):
                    # Fresh prompts each repeat: nothing the prefix cache holds.
                    prompts = make_prompts(
                        config.vocab_size, concurrency, args.input_len, 1000 * repeat + concurrency
                    )
                    for name, llm in engines.items():
                        runs[name].append(run(llm, prompts, args.output_len, workload))
                        loads.append(os.getloadavg()[0])
                    assert runs["off"][-1]["outputs"] == runs["ngram"][-1]["outputs"], (
                        "speculation changed a greedy output"
                    )
                off, ngram = median(runs["off"]), median(runs["ngram"])
                key = f"{workload}/{concurrency}"
                results[key] = {
                    "off": off,
                    "ngram": ngram,
                    "speedup": ngram["output_tokens_per_s"] / off["output_tokens_per_s"],
                }
                print(
                    f"{key:>10}: off {off['output_tokens_per_s']:7.1f} tok/s, ngram "
                    f"{ngram['output_tokens_per_s']:7.1f} tok/s ({results[key]['speedup']:.2f}x), "
                    f"acceptance {ngram['acceptance_rate']}",
                    flush=True,
                )
        for llm in engines.values():
            llm.close()
    record = {
        "benchmark": "spec_decode",
        "model": f"tiny-model --size {args.size} (llama), dtype {dtype}",
        "speculative_config": spec,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "greedy": True,
            "allowed_token_ids": WORKLOADS,
            "json_schema": ITEMS,
            "repeats": args.repeats,
            "compilation_level": args.compilation_level,
        },
        "machine": torch_machine(loads),
        "results": results,
        "date": time.strftime("%Y-%m-%d"),
    }
    write_record(args.out, record)


if __name__ == "__main__":
    main()
