"""auto-chunk-serving: what auto chunking costs and buys on the serving workload.

The serving comparison's requests (48 of 128-512 prompt tokens and 64-128 output tokens) at 2
and 4 req/s, on the small model, against four servers, alternating, --rounds times: no
per-request cap (the engine's default), `--long-prefill-token-threshold auto` at the default
slack and at 0.5 (the default until 2026-12-06), and auto with `--long-prefill-step-ms 50`
(what the operator gives CPU pods at its default ITL SLO). Reported per server and rate: the
medians over the rounds of TTFT p50/p99, TPOT p50, ITL p99 and output tokens/s.

    python benchmarks/auto_chunk_serving.py [--rounds N]   # writes results/auto_chunk_serving.json

--smoke runs one round of 8 short requests a rate on the tiny model (seconds, for tests).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from common import RESULTS, machine, model_dir, tidegate_server, write_result
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import random_workload

SERVERS = {
    "no cap": [],
    "auto": ["--long-prefill-token-threshold", "auto"],
    "auto, slack 0.5": [
        "--long-prefill-token-threshold",
        "auto",
        "--long-prefill-step-slack",
        "0.5",
    ],
    "auto, 50 ms steps": ["--long-prefill-token-threshold", "auto", "--long-prefill-step-ms", "50"],
}
RATES = (2.0, 4.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 8 short requests")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    model = model_dir("tiny" if args.smoke else "small")
    # (requests, prompt tokens, output tokens) a rate.
    shape = (8, (32, 64), (8, 16)) if args.smoke else (48, (128, 512), (64, 128))
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in SERVERS}
    for round_index in range(args.rounds):
        for name, flags in SERVERS.items():
            with tidegate_server(model, *flags) as server:
                server.wait_healthy()
                warmup = random_workload(4, (64, 64), (8, 8), seed=1000)
                run_bench(server.base_url, "m", warmup, progress=False)
                for i, rate in enumerate(RATES):
                    workload = random_workload(*shape, seed=i)
                    result, _ = run_bench(
                        server.base_url, "m", workload, request_rate=rate, seed=0, progress=False
                    )
                    row = {
                        "completed": result["completed"],
                        "failed": result["failed"],
                        "ttft_p50_ms": result["ttft_ms"]["p50"],
                        "ttft_p99_ms": result["ttft_ms"]["p99"],
                        "tpot_p50_ms": result["tpot_ms"]["p50"],
                        "itl_p99_ms": result["itl_ms"]["p99"],
                        "output_tok_s": result["output_token_throughput"],
                        "load_average_1m": round(os.getloadavg()[0], 2),
                    }
                    runs[name].setdefault(str(rate), []).append(row)
                    print(f"[{round_index + 1}/{args.rounds}] {name:18s} {rate} req/s {row}")
    medians = {
        name: {
            rate: {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
            for rate, rows in by_rate.items()
        }
        for name, by_rate in runs.items()
    }
    write_result(
        "auto_chunk_serving",
        {
            "command": f"python benchmarks/auto_chunk_serving.py --rounds {args.rounds}"
            + (" --smoke" if args.smoke else ""),
            "machine": machine(),
            "model": "tiny" if args.smoke else "small",
            "medians": medians,
            "runs": runs,
        },
        args.out_dir,
    )


if __name__ == "__main__":
    main()
