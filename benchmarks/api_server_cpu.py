"""api-server-cpu: the API server process's CPU time per streamed output token.

32 token streams x 128 output tokens (`ignore_eos`, streamed `/v1/completions`) against
`tidegate serve` on the tiny model: 32 requests with n=1, then 8 requests with n=4 (one step
gives each response four tokens). The API server's user + system CPU time is read from
/proc/<pid>/stat before and after each load; the engine core and its workers are other
processes and are not counted, so the figure is what HTTP, detokenizing and SSE cost. Each
run starts a fresh server and warms it with one request first; the median of the runs is
kept under `--label` in results/api_server_cpu.json, beside the other labels already there,
so one file holds the figure before and after a change.

    python benchmarks/api_server_cpu.py --label before --runs 3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import (
    machine,
    model_dir,
    scenario_parser,
    table,
    tidegate_server,
    update_readme,
)
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import random_workload

NAME = "api_server_cpu"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: utime and stime are fields 14 and 15 of proc(5), here 11 and 12.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# name -> (concurrent requests, choices per request): 32 token streams either way. With n=4,
# one engine step gives each response four tokens at once.
SCENARIOS = {"n=1": (32, 1), "n=4": (8, 4)}


def measure(base_url: str, pid: int, requests: int, n: int, output_len: int) -> dict:
    """One load against a warm server; the API server's CPU-ms per output token."""
    workload = random_workload(requests, (32, 32), (output_len, output_len), seed=0)
    before = cpu_seconds(pid)
    result, records = run_bench(base_url, "m", workload, extra_body={"n": n}, progress=False)
    used = cpu_seconds(pid) - before
    tokens = sum(r.output_tokens for r in records)
    failed = [r.error for r in records if not r.ok]
    if failed or tokens != requests * n * output_len:
        raise RuntimeError(f"{len(failed)} requests failed ({failed[:1]}), {tokens} tokens")
    return {
        "api_server_cpu_s": round(used, 3),
        "output_tokens": tokens,
        "cpu_ms_per_token": round(1000 * used / tokens, 4),
        "duration_s": result["duration_s"],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def one_run(model: Path, scale: int, output_len: int) -> dict[str, dict]:
    """A fresh server, one warm-up request, then every scenario in turn."""
    server = tidegate_server(model, "--enforce-eager", "--log-level", "warning")
    with server:
        server.wait_healthy()
        pid = server.process.pid  # `tidegate serve` is the API server (tidegate::api)
        warm = random_workload(1, (32, 32), (8, 8), seed=1)
        run_bench(server.base_url, "m", warm, progress=False)
        return {
            name: measure(server.base_url, pid, max(1, requests // scale), n, output_len)
            for name, (requests, n) in SCENARIOS.items()
        }


def git_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()


def readme_section(record: dict) -> str:
    labels = record["labels"]
    rows = [
        [
            label,
            entry["commit"],
            *(entry["cpu_ms_per_token"][name] for name in SCENARIOS),
            entry["load_average_1m"],
        ]
        for label, entry in labels.items()
    ]
    header = ["label", "commit", *(f"CPU-ms / token, {name}" for name in SCENARIOS), "load avg"]
    first = next(iter(labels.values()))
    title = (
        f"### api-server-cpu (tiny model, 32 token streams x {first['output_len']} tokens: "
        "32 requests with n=1, 8 with n=4; API server process only, median of runs)"
    )
    return f"{title}\n\n{table(header, rows)}\n\n`{record['command']}`"


def main() -> None:
    parser = scenario_parser(__doc__)
    parser.add_argument("--label", default="current", help="the key this run is kept under")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    # The smoke run still streams 512 tokens per scenario: the process's CPU time is counted
    # in 10 ms ticks, which a few dozen tokens may not reach.
    scale, output_len, runs = (2, 32, 1) if args.smoke else (1, args.output_len, args.runs)
    model = model_dir("tiny")
    samples = []
    for i in range(runs):
        samples.append(one_run(model, scale, output_len))
        print(f"run {i + 1}: {json.dumps(samples[-1])}", flush=True)
    path = args.out_dir / f"{NAME}.json"
    record = json.loads(path.read_text()) if path.exists() else {"benchmark": NAME}
    record["command"] = "python benchmarks/api_server_cpu.py " + " ".join(sys.argv[1:])
    record.setdefault("labels", {})[args.label] = {
        "commit": git_commit(),
        "output_len": output_len,
        "scenarios": {name: {"requests": r // scale, "n": n} for name, (r, n) in SCENARIOS.items()},
        "cpu_ms_per_token": {
            name: round(statistics.median(s[name]["cpu_ms_per_token"] for s in samples), 4)
            for name in SCENARIOS
        },
        "load_average_1m": round(
            statistics.median(s[name]["load_average_1m"] for s in samples for name in SCENARIOS), 2
        ),
        "machine": machine(),
        "runs": samples,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{args.label}: {record['labels'][args.label]['cpu_ms_per_token']} CPU-ms/token -> {path}"
    )
    update_readme(args.readme, "api-server-cpu", readme_section(record))


if __name__ == "__main__":
    main()
