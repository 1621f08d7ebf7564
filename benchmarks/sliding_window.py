"""What sliding windows save: the same Gemma 3 weights with its sliding-window layers, and
with every layer full attention, on long prompts.

The small Gemma 3 (`tidegate make-tiny-model --arch gemma3 --size small`: 12 layers, ten of
them with a 256-token window, two full) is copied with `layer_types` all full_attention, so
both engines run the same weights and differ only in how many keys ten layers read. Each
concurrency and prompt length times the prefill (max_tokens 1) and then the whole request
(1 + --output-len tokens, greedy, EOS ignored); decode tokens/s is the output tokens after
the first over the time the whole run took beyond the prefill. Prefix caching is off, so
each run computes its prompts. The two engines alternate, median of --repeats. The outputs
differ (the windows change what the model computes), so none is compared. Writes a JSON
record.

    python benchmarks/sliding_window.py --out benchmarks/results/sliding_window.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts, torch_machine, write_record


def full_attention_copy(model: Path, out: Path) -> Path:
    """The folder with every layer full attention: the same weights, no windows."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def timed(llm, prompts, max_tokens: int) -> float:
    from tidegate.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def run(llm, prompts, output_len: int) -> dict:
    prefill = timed(llm, prompts, 1)
    whole = timed(llm, prompts, 1 + output_len)
    decode = max(whole - prefill, 1e-9)
    return {
        "prefill_s": prefill,
        "prompt_tokens_per_s": sum(map(len, prompts)) / prefill,
        "whole_s": whole,
        "decode_tokens_per_s": len(prompts) * output_len / decode,
        "decode_ms_per_step": 1000 * decode / output_len,
    }


def median(runs: list[dict]) -> dict:
    middle = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    middle["all_decode_tokens_per_s"] = [round(r["decode_tokens_per_s"], 1) for r in runs]
    return middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024, 3072])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--compilation-level", type=int, choices=[0, 1], default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tidegate.engine import LLM
    from tidegate.engine.model.config import ModelConfig
    from tidegate.engine.tiny_model import make_tiny_model

    results: dict[str, dict] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        windowed = make_tiny_model(Path(tmp) / "windowed", arch="gemma3", size=args.size)
        full = full_attention_copy(windowed, Path(tmp) / "full")
        config = ModelConfig.from_pretrained(windowed)
        common = dict(
            enable_prefix_caching=False,
            attention_backend=args.attention_backend,
            compilation_level=args.compilation_level,
            max_model_len=max(args.input_len) + args.output_len + 1,
        )
        engines = {"windowed": LLM(str(windowed), **common), "full": LLM(str(full), **common)}
        dtype = str(engines["full"].engine.args.dtype)
        backend = engines["full"].engine.executor.worker.runner.attn_backend.name
        for llm in engines.values():  # start-up and compilation, untimed
            timed(llm, make_prompts(config.vocab_size, 2, 64, 99), 4)
        for input_len in args.input_len:
            for concurrency in args.concurrency:
                runs: dict[str, list[dict]] = {name: [] for name in engines}
                for repeat in range(args.repeats):
                    prompts = make_prompts(
                        config.vocab_size, concurrency, input_len, 1000 * repeat + concurrency
                    )
                    for name, llm in engines.items():
                        runs[name].append(run(llm, prompts, args.output_len))
                        loads.append(os.getloadavg()[0])
                rows = {name: median(r) for name, r in runs.items()}
                key = f"{input_len}/{concurrency}"
                results[key] = {
                    **rows,
                    "decode_speedup": rows["windowed"]["decode_tokens_per_s"]
                    / rows["full"]["decode_tokens_per_s"],
                    "prefill_speedup": rows["full"]["prefill_s"] / rows["windowed"]["prefill_s"],
                }
                print(
                    f"{key:>10}: decode {rows['full']['decode_tokens_per_s']:7.1f} -> "
                    f"{rows['windowed']['decode_tokens_per_s']:7.1f} tok/s "
                    f"({results[key]['decode_speedup']:.2f}x), prefill "
                    f"{rows['full']['prefill_s']:.2f} -> {rows['windowed']['prefill_s']:.2f} s "
                    f"({results[key]['prefill_speedup']:.2f}x)",
                    flush=True,
                )
        for llm in engines.values():
            llm.close()
    record = {
        "benchmark": "sliding_window",
        "model": (
            f"tiny-model --arch gemma3 --size {args.size}, dtype {dtype}, windows "
            f"{list(config.layer_windows)} against all full"
        ),
        "attention_backend": backend,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "greedy": True,
            "prefix_caching": False,
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
