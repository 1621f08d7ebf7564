"""executor-backend: `tidegate serve` at TP=1, the worker in the engine core (uni) or not (mp),
with steps planned one at a time or while the last one runs (async scheduling).

mp puts the model in a third process: each step's SchedulerOutput is encoded, written to the
shared-memory ring and decoded, and the sampled tokens come back over a pipe. uni calls the
worker directly. The difference is per step, so it shows most on one stream alone (TPOT),
and less on a batch, where the model's time dominates. One server per arm is started (one
after the other), then the runs alternate between them (uni, mp, uni, mp, ...) so that a
change of the machine's load hits both; each run sends prompts new to the servers, and the
median of each arm's runs is kept. The load average is recorded around every run.

An arm is a backend with optional suffixes: `-async` adds --async-scheduling (the engine core
plans step N+1 and sends step N's tokens while step N+1 runs), `-passive` sets
OMP_WAIT_POLICY=PASSIVE (OpenMP's idle threads sleep at once instead of spinning a while
first: slower on a quiet machine, much faster when other processes want the same cores).
Ratios compare every arm with the first.

    python benchmarks/executor_backend.py                                 # small: uni, mp
    python benchmarks/executor_backend.py --arms uni,uni-async --name async_scheduling
    python benchmarks/executor_backend.py --size tiny --enforce-eager --arms uni,mp,uni-passive
    python benchmarks/executor_backend.py --smoke                         # tiny, seconds
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

from common import (
    lookup,
    machine,
    model_dir,
    scenario_parser,
    table,
    update_readme,
    write_result,
)
from tidegate.common.local_server import LocalServer, free_port, serve_command
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import random_workload

BACKENDS = ("uni", "mp")
SUFFIXES = {"async": ["--async-scheduling"], "passive": []}


def arm_settings(arm: str) -> tuple[list[str], dict[str, str] | None]:
    """Server flags and environment of an arm such as `uni`, `mp-async` or `uni-passive`."""
    backend, *suffixes = arm.split("-")
    if backend not in BACKENDS or not set(suffixes) <= set(SUFFIXES):
        raise SystemExit(f"unknown arm {arm!r}: a backend of {BACKENDS}, then -async, -passive")
    flags = ["--distributed-executor-backend", backend]
    for suffix in suffixes:
        flags += SUFFIXES[suffix]
    return flags, {"OMP_WAIT_POLICY": "PASSIVE"} if "passive" in suffixes else None


def start_server(model, arm: str, args) -> tuple[LocalServer, float]:
    """A server for this arm, healthy; and the seconds it took."""
    arm_flags, env = arm_settings(arm)
    flags = [*arm_flags, "--log-level", "warning", *args.flags]
    port = free_port()
    common = ("--served-model-name", "m", "--dtype", "bfloat16")  # as tidegate_server()
    command = serve_command(model, *common, *flags, port=port)
    started = time.perf_counter()
    server = LocalServer(command, port, log=subprocess.DEVNULL, env=env)
    try:
        server.wait_healthy(300)
        warm = random_workload(4, (args.input_len,) * 2, (8, 8), seed=99)
        run_bench(server.base_url, "m", warm, progress=False)
    except BaseException:
        server.stop()
        raise
    return server, round(time.perf_counter() - started, 2)


def one_run(server: LocalServer, arm: str, repeat: int, args) -> dict:
    """One stream alone, then a burst; prompts new to the server (seeded by the repeat)."""
    load_before = round(os.getloadavg()[0], 2)
    single = random_workload(1, (args.input_len,) * 2, (args.stream_len,) * 2, seed=repeat)
    stream, _ = run_bench(server.base_url, "m", single, progress=False)
    burst = random_workload(
        args.burst, (args.input_len,) * 2, (args.output_len,) * 2, seed=1000 + repeat
    )
    batch, _ = run_bench(server.base_url, "m", burst, progress=False)
    for result in (stream, batch):
        assert result["failed"] == 0, result
    return {
        "backend": arm,
        "repeat": repeat,
        "one_stream": {
            # Time per output token after the first: steps bunch SSE events, so gaps mislead.
            "tpot_ms": lookup(stream, "tpot_ms", "p50"),
            "output_tokens_per_s": stream["output_token_throughput"],
        },
        "burst": {
            "output_tokens_per_s": batch["output_token_throughput"],
            "tpot_p50_ms": lookup(batch, "tpot_ms", "p50"),
            "ttft_p50_ms": lookup(batch, "ttft_ms", "p50"),
        },
        "load_average_1m_before": load_before,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def medians(runs: list[dict]) -> dict:
    """Each figure's median over one backend's runs."""

    def median(*keys: str) -> float:
        return round(statistics.median(lookup(run, *keys) for run in runs), 3)

    return {
        "one_stream_tpot_ms": median("one_stream", "tpot_ms"),
        "one_stream_output_tokens_per_s": median("one_stream", "output_tokens_per_s"),
        "burst_output_tokens_per_s": median("burst", "output_tokens_per_s"),
        "burst_tpot_p50_ms": median("burst", "tpot_p50_ms"),
    }


def main() -> None:
    parser = scenario_parser(__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--enforce-eager", action="store_true", help="both arms at level 0")
    parser.add_argument("--arms", default="uni,mp", help="comma-separated; the first is the base")
    parser.add_argument("--name", default="executor_backend", help="result file and README key")
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm, alternating")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--stream-len", type=int, default=64, help="tokens of the lone stream")
    parser.add_argument("--burst", type=int, default=16, help="concurrent requests")
    parser.add_argument("--output-len", type=int, default=32, help="tokens of each burst request")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.enforce_eager, args.repeats = "tiny", True, 1
        args.stream_len, args.burst, args.output_len = 16, 4, 8
    args.flags = ["--enforce-eager"] if args.enforce_eager else []
    arms = args.arms.split(",")
    for arm in arms:
        arm_settings(arm)  # unknown arms fail before any server starts
    model = model_dir(args.size)
    # One server per arm, started one after the other; an idle server uses no CPU. Then the
    # runs alternate between them, so that the machine's load changes hit every arm alike.
    servers: dict[str, LocalServer] = {}
    startup_s: dict[str, float] = {}
    try:
        for arm in arms:
            servers[arm], startup_s[arm] = start_server(model, arm, args)
        runs = [
            one_run(servers[arm], arm, repeat, args)
            for repeat in range(args.repeats)
            for arm in arms
        ]
    finally:
        for server in servers.values():
            server.stop()
    summary = {arm: medians([r for r in runs if r["backend"] == arm]) for arm in arms}
    base = summary[arms[0]]
    ratios = {
        f"{arm}_vs_{arms[0]}": {
            "one_stream_tpot": round(figures["one_stream_tpot_ms"] / base["one_stream_tpot_ms"], 3),
            "burst_throughput": round(
                figures["burst_output_tokens_per_s"] / base["burst_output_tokens_per_s"], 3
            ),
        }
        for arm, figures in summary.items()
        if arm != arms[0]
    }
    for arm, figures in summary.items():
        print(arm, figures)
    print(ratios)
    argv = [f"--size {args.size}"] + ["--enforce-eager"] * args.enforce_eager
    argv += [f"--arms {args.arms}", f"--name {args.name}", f"--repeats {args.repeats}"]
    command = "python benchmarks/executor_backend.py " + (
        "--smoke" if args.smoke else " ".join(argv)
    )
    level = "eager" if args.enforce_eager else "default compilation level (1 on CPU)"
    record = {
        "command": command,
        "model": args.size,
        "dtype": "bfloat16",
        "compilation": level,
        "workload": {
            "input_len": args.input_len,
            "one_stream_output_len": args.stream_len,
            "burst_requests": args.burst,
            "burst_output_len": args.output_len,
            "repeats_per_arm": args.repeats,
            "order": [run["backend"] for run in runs],
        },
        "median": summary,
        "ratios": ratios,
        "startup_s": startup_s,
        "runs": runs,
        "machine": machine(),
    }
    name = f"{args.name}_{args.size}"
    print(f"wrote {write_result(name, record, args.out_dir)}")
    rows = [
        [
            arm,
            figures["one_stream_tpot_ms"],
            figures["one_stream_output_tokens_per_s"],
            figures["burst_output_tokens_per_s"],
            figures["burst_tpot_p50_ms"],
        ]
        for arm, figures in summary.items()
    ]
    loads = [run["load_average_1m_before"] for run in runs]
    loads += [run["load_average_1m_after"] for run in runs]
    header = ["arm", "one stream TPOT (ms)", "one stream tok/s", "burst tok/s"]
    compared = "; ".join(
        f"{key.replace('_vs_', ' / ')}: one-stream TPOT **{r['one_stream_tpot']}**, burst "
        f"throughput **{r['burst_throughput']}**"
        for key, r in ratios.items()
    )
    update_readme(
        args.readme,
        f"{args.name.replace('_', '-')}-{args.size}",
        f"### {args.name.replace('_', ' ')} at TP=1 ({args.size} model, {level}, median of "
        f"{args.repeats} alternating runs per arm)\n\n"
        + table([*header, "burst TPOT p50 (ms)"], rows)
        + f"\n\n`{command}`: one stream of {args.stream_len} tokens alone, then {args.burst} "
        f"requests at once ({args.input_len} tokens in, {args.output_len} out). {compared}. "
        f"1-minute load average {min(loads)}-{max(loads)} during the runs.",
    )


if __name__ == "__main__":
    main()
