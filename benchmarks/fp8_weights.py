"""FP8 weights: memory, load time, decode speed and greedy agreement against the model's own
16/32-bit weights.

The small Llama (`tidegate make-tiny-model --size small`) and its FP8 checkpoint (the same
weights written with `--quantize fp8-block`: 128 x 128 blocks, transformers' fp8 layout) run
as four engines on this machine's device:
- `unquantized`: the 16/32-bit folder as it is (the baseline);
- `quantized-at-load`: the same folder under `--quantization fp8` (per-row scales);
- `fp8-checkpoint`: the FP8 folder under `auto` (FP8 products on CUDA 8.9+; dequantized at
  load elsewhere);
- `fp8-checkpoint-fp8`: the FP8 folder under `--quantization fp8`.
For each: seconds to start the engine, bytes of the model's parameters, decode tokens/s at
each batch size (greedy, EOS ignored; the prefill is timed apart and subtracted), and, with
--agreement-prompts prompts as context, how often each position's most likely next token is
the baseline's and how far the prompt tokens' log-probabilities move (random tiny weights
have no redundancy to absorb rounding: a lower bound for real models). Where FP8 products are emulated (CPU), the fp8 engines
measure the emulation, which nobody should serve with. The engines alternate, median of
--repeats. Writes a JSON record.

    python benchmarks/fp8_weights.py --out benchmarks/results/fp8_weights.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts, torch_machine, write_record

VARIANTS = {
    "unquantized": ("plain", "auto"),
    "quantized-at-load": ("plain", "fp8"),
    "fp8-checkpoint": ("fp8", "auto"),
    "fp8-checkpoint-fp8": ("fp8", "fp8"),
}


def parameter_bytes(llm) -> int:
    model = llm.engine.executor.worker.runner.model
    seen, total = set(), 0
    for tensor in [
        *model.parameters(),
        *(m.packed for m in model.modules() if hasattr(m, "packed") and m.packed is not None),
    ]:
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def timed(llm, prompts, max_tokens: int) -> float:
    from tidegate.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return time.perf_counter() - start


def scored(llm, prompts) -> list[list[tuple[int, float]]]:
    """Per prompt position after the first: (the most likely next token, the log-probability
    of the prompt's own next token), with the prompt as context (teacher forcing)."""
    from tidegate.engine import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    rows = []
    for prompt, output in zip(prompts, outputs, strict=True):
        row = []
        for token, entry in zip(prompt[1:], output.prompt_logprobs[1:], strict=True):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            row.append((top, entry[token].logprob))
        rows.append(row)
    return rows


def agreement(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]]) -> dict:
    """How often the most likely next token is the baseline's, and how far the prompt
    tokens' log-probabilities move, over every position of every prompt."""
    pairs = [
        (g, w)
        for g_row, w_row in zip(got, want, strict=True)
        for g, w in zip(g_row, w_row, strict=True)
    ]
    return {
        "top1_agreement": round(sum(g[0] == w[0] for g, w in pairs) / len(pairs), 4),
        "mean_abs_logprob_change": round(statistics.mean(abs(g[1] - w[1]) for g, w in pairs), 4),
        "positions": len(pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--agreement-prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tidegate.engine import LLM
    from tidegate.engine.model.config import ModelConfig
    from tidegate.engine.tiny_model import make_tiny_model

    loads = [os.getloadavg()[0]]
    results: dict[str, dict] = {name: {} for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {
            "plain": make_tiny_model(Path(tmp) / "plain", size=args.size),
            "fp8": make_tiny_model(Path(tmp) / "fp8", size=args.size, quantize="fp8-block"),
        }
        config = ModelConfig.from_pretrained(folders["plain"])
        engines = {}
        for name, (folder, quantization) in VARIANTS.items():
            start = time.perf_counter()
            engines[name] = LLM(
                str(folders[folder]),
                dtype=args.dtype,
                quantization=quantization,
                max_model_len=args.input_len + args.output_len + 1,
            )
            results[name]["start_s"] = round(time.perf_counter() - start, 2)
            results[name]["parameter_bytes"] = parameter_bytes(engines[name])
        device = str(engines["unquantized"].engine.executor.worker.runner.device)
        dtype = str(engines["unquantized"].engine.executor.worker.runner.dtype)
        prompts = make_prompts(config.vocab_size, args.agreement_prompts, args.input_len, 7)
        scores = {name: scored(llm, prompts) for name, llm in engines.items()}
        for name in engines:
            results[name].update(agreement(scores[name], scores["unquantized"]))
        for batch in args.batch_sizes:
            warm_up = make_prompts(config.vocab_size, batch, args.input_len, 99)
            for llm in engines.values():  # the step shapes of the timed runs, untimed
                timed(llm, warm_up, 1 + args.output_len)
            runs: dict[str, list[float]] = {name: [] for name in engines}
            for repeat in range(args.repeats):
                prompts = make_prompts(config.vocab_size, batch, args.input_len, 100 * repeat)
                for name, llm in engines.items():
                    prefill = timed(llm, prompts, 1)
                    whole = timed(llm, prompts, 1 + args.output_len)
                    runs[name].append(batch * args.output_len / max(whole - prefill, 1e-9))
                    loads.append(os.getloadavg()[0])
            for name, values in runs.items():
                results[name][f"decode_tokens_per_s_batch_{batch}"] = round(
                    statistics.median(values), 1
                )
        for llm in engines.values():
            llm.close()
    base = results["unquantized"]
    for name, row in results.items():
        row["parameter_bytes_vs_unquantized"] = round(
            row["parameter_bytes"] / base["parameter_bytes"], 3
        )
        print(f"{name:>20}: {row}", flush=True)
    record = {
        "benchmark": "fp8_weights",
        "model": f"tiny-model --size {args.size} (llama), and --quantize fp8-block",
        "device": device,
        "dtype": dtype,
        "workload": {
            "batch_sizes": args.batch_sizes,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "agreement_prompts": args.agreement_prompts,
            "repeats": args.repeats,
        },
        "machine": torch_machine(loads),
        "results": results,
    }
    write_record(args.out, record)


if __name__ == "__main__":
    main()
