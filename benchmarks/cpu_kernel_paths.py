"""Two things the C++ cpu kernel used to leave to the torch backend, timed on both: Gemma 2's
capped attention scores, and an FP8 KV cache.

- gemma2: the small Gemma 2 (`tidegate make-tiny-model --arch gemma2 --size small`: every
  other layer windowed, scores capped) on `--attention-backend torch` and `cpu`.
- fp8_kv: the small Llama with `--kv-cache-dtype fp8` on `torch` and `cpu`, and on `cpu`
  with a cache of the model's own dtype (what FP8 costs or saves on the kernel).

Each prompt length and concurrency times the prefill (max_tokens 1) and then the whole
request (1 + --output-len tokens, greedy, EOS ignored), as benchmarks/sliding_window.py
does; decode tokens/s is the output tokens after the first over the time the whole run took
beyond the prefill. Prefix caching is off. The engines of a group alternate, median of
--repeats. Greedy tokens of the last repeat are compared with the group's first engine
(`same_tokens`: the share of requests whose tokens are all equal). Writes a JSON record.

    python benchmarks/cpu_kernel_paths.py --out benchmarks/results/cpu_kernel_paths.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts, torch_machine, write_record
from sliding_window import median, run

GROUPS = {
    "gemma2": ("gemma2", {"torch": {"attention_backend": "torch"}, "cpu": {}}),
    "fp8_kv": (
        "llama",
        {
            "torch fp8": {"attention_backend": "torch", "kv_cache_dtype": "fp8"},
            "cpu fp8": {"kv_cache_dtype": "fp8"},
            "cpu model dtype": {},
        },
    ),
}


def greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    from tidegate.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def bench_group(name: str, args, loads: list[float], tmp: Path) -> dict:
    from tidegate.engine import LLM
    from tidegate.engine.model.config import ModelConfig
    from tidegate.engine.tiny_model import make_tiny_model

    arch, variants = GROUPS[name]
    model = make_tiny_model(tmp / name, arch=arch, size=args.size)
    config = ModelConfig.from_pretrained(model)
    common = dict(
        attention_backend="cpu",
        enable_prefix_caching=False,
        compilation_level=args.compilation_level,
        max_model_len=max(args.input_len) + args.output_len + 1,
    )
    engines = {label: LLM(str(model), **{**common, **extra}) for label, extra in variants.items()}
    for label, llm in engines.items():  # start-up and compilation, untimed
        runner = llm.engine.executor.worker.runner
        print(f"{name} {label}: {runner.attn_backend.name}, cache {runner.kv_caches[0][0].dtype}")
        greedy(llm, make_prompts(config.vocab_size, 2, 16, 99), 4)
    dtype = str(next(iter(engines.values())).engine.args.dtype)
    results: dict[str, dict] = {}
    for input_len in args.input_len:
        for concurrency in args.concurrency:
            runs: dict[str, list[dict]] = {label: [] for label in engines}
            for repeat in range(args.repeats):
                prompts = make_prompts(
                    config.vocab_size, concurrency, input_len, 1000 * repeat + concurrency
                )
                for label, llm in engines.items():
                    runs[label].append(run(llm, prompts, args.output_len))
                    loads.append(os.getloadavg()[0])
            rows = {label: median(r) for label, r in runs.items()}
            tokens = {
                label: greedy(llm, prompts, args.output_len) for label, llm in engines.items()
            }
            first = next(iter(engines))
            for label in engines:
                same = sum(a == b for a, b in zip(tokens[label], tokens[first], strict=True))
                rows[label]["same_tokens"] = same / len(prompts)
            key = f"{input_len}/{concurrency}"
            results[key] = rows
            print(
                f"{name} {key:>9}: "
                + ", ".join(
                    f"{label} decode {row['decode_tokens_per_s']:.1f} tok/s, "
                    f"prefill {row['prefill_s']:.2f} s"
                    for label, row in rows.items()
                ),
                flush=True,
            )
    for llm in engines.values():
        llm.close()
    return {"model": f"tiny-model --arch {arch} --size {args.size}, dtype {dtype}", **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--size", default="small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024, 3072])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compilation-level", type=int, choices=[0, 1], default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: bench_group(name, args, loads, Path(tmp)) for name in args.groups}
    record = {
        "benchmark": "cpu_kernel_paths",
        "workload": {
            "input_len": args.input_len,
            "concurrency": args.concurrency,
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
