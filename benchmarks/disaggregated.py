"""disaggregated: does a long prefill on the producer reach the decode side's tokens?

Steady streams decode on the `small` model; after a baseline period, 2k-4k-token prompts
arrive (the prefill-stall workload). Two deployments, one after the other in the same run:

- unified: one `tidegate serve` with auto chunks (prefill-stall's best unified setting) that
  prefills the long prompts and decodes the steady streams on the same core;
- disaggregated: a producer (`--kv-role producer`, prefill) and a consumer (`--kv-role
  consumer`, decode, the unified server's flags) behind `tidegate router`, which the client
  talks to; the consumer pulls each prompt's KV from the producer over TCP.

In production prefill and decode run on different machines; here each engine gets one core
and one torch thread instead: producer on core 0, consumer on core 1, and the unified server
on core 1 as well, so both deployments decode on one core and only the disaggregated one has
a second core for prefill (which is the point). The router and this load client run on core
0. Reported: p50/p99 inter-token latency of the steady streams before the long prompts
arrive and while they prefill, the ratio during / before, and the long prompts' TTFT.

With --kv-encryption the two arms are instead the disaggregated deployment with plain KV
transfer and with `--kv-encryption curve`, alternated --repeats times on the same workload:
the cost of encryption in throughput, TTFT and pull latency (medians of the runs). It also times one rank's pull
of a long prompt's worth of the small model's KV (45 MiB) over loopback, each way, where the
whole cost of CURVE lies.

    python benchmarks/disaggregated.py                  # results/disaggregated.{json,png}
    python benchmarks/disaggregated.py --kv-encryption  # results/disaggregated_encryption.json
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from common import (
    lookup,
    machine,
    scenario_parser,
    scrape,
    stall_scenario,
    table,
    tidegate_server,
    update_readme,
    write_result,
)
from tidegate.common.local_server import LocalServer
from tidegate.engine.bench.plot import plot_run
from tidegate.engine.bench.serve import run_bench
from tidegate.operator.kv_keys import write_key_dir

ENGINE_FLAGS = ["--num-threads", "1"]
DECODE_FLAGS = ["--long-prefill-token-threshold", "auto"]
KV_FLAGS = ["--kv-host", "127.0.0.1", "--kv-port", "0"]
FLAGS = {
    "unified": [*ENGINE_FLAGS, *DECODE_FLAGS],
    "producer": [*ENGINE_FLAGS, "--kv-role", "producer", *KV_FLAGS],
    "consumer": [*ENGINE_FLAGS, *DECODE_FLAGS, "--kv-role", "consumer", *KV_FLAGS],
}
# What each engine's /metrics says about where prompts were computed and how KV moved.
KV_METRICS = (
    "prompt_tokens_computed_total",
    "kv_received_bytes_total",
    "kv_transfer_fallbacks_total",
    "kv_pins_expired_total",
)
# The "unaffected", in numbers: prefill-stall's target for its own ratio.
FLAT_RATIO = 1.5
# Outside load (percent of one core) above which the finding says the machine was busy.
QUIET_PERCENT = 10


def cores() -> dict[str, object]:
    """Which core each process runs on (one core each where the machine has two)."""
    if (os.cpu_count() or 1) >= 2:
        return {"producer": 0, "consumer": 1, "unified": 1, "router and load client": 0}
    return {
        "producer": 0,
        "consumer": 0,
        "unified": 0,
        "router and load client": 0,
        "note": "this machine has one core: every process shares core 0",
    }


@contextlib.contextmanager
def on_core(core: int) -> Iterator[None]:
    """Processes started inside inherit this thread's affinity: one core."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@contextlib.contextmanager
def unified(model: Path, placement: dict) -> Iterator[tuple[str, dict[str, LocalServer]]]:
    """One `tidegate serve`: (URL the client talks to, every process of the deployment)."""
    with on_core(placement["unified"]):
        server = tidegate_server(model, *FLAGS["unified"])
    with server:
        server.wait_healthy()
        yield server.base_url, {"unified": server}


@contextlib.contextmanager
def disaggregated(
    model: Path, placement: dict, kv_flags: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict[str, LocalServer]]]:
    """Producer, consumer and the router in front of them (the client talks to the router);
    `kv_flags` go to both engines."""
    with on_core(placement["producer"]):
        producer = tidegate_server(model, *FLAGS["producer"], *kv_flags)
    with on_core(placement["consumer"]):
        consumer = tidegate_server(model, *FLAGS["consumer"], *kv_flags)
    with producer, consumer:
        producer.wait_healthy()
        consumer.wait_healthy()
        router = LocalServer.tidegate_router(
            [producer.base_url], [consumer.base_url], "--health-interval", "0.5",
            log=subprocess.DEVNULL,
        )  # fmt: skip
        with router as r:
            r.wait_healthy()
            yield r.base_url, {"producer": producer, "consumer": consumer, "router": r}


class OutsideLoad:
    """CPU seconds the machine spent on processes other than this benchmark's, meanwhile.

    Every figure here assumes a quiet machine; this says whether it was (approximately:
    kernel threads count as outside).
    """

    def __init__(self, servers: list[LocalServer]) -> None:
        # Each server runs in its own session, so its engine and worker processes share its id.
        self.sessions = {server.process.pid for server in servers}
        self.start = (_busy_cpu_s(), self._ours())

    def _ours(self) -> float:
        total = _process_cpu_s(Path("/proc/self/stat"))
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int(stat.read_text().rsplit(")", 1)[1].split()[3]) in self.sessions:
                    total += _process_cpu_s(stat)
        return total

    def measure(self) -> dict[str, float]:
        """This benchmark's CPU seconds since the start, and everyone else's."""
        busy, ours = _busy_cpu_s() - self.start[0], self._ours() - self.start[1]
        return {"benchmark_cpu_s": round(ours, 1), "outside_cpu_s": round(max(busy - ours, 0), 1)}


def _busy_cpu_s() -> float:
    """user + nice + system seconds of all cores since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4]
    return sum(int(field) for field in fields) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(stat: Path) -> float:
    """utime + stime of one process (all its threads)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SETUPS = {"unified": unified, "disaggregated": disaggregated}


def main() -> None:
    parser = scenario_parser(__doc__)
    parser.add_argument(
        "--kv-encryption",
        action="store_true",
        help="compare plain and CURVE KV transfer (results/disaggregated_encryption.json)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternated")
    args = parser.parse_args()
    if args.kv_encryption:
        compare_encryption(args)
        return
    scenario = stall_scenario(args.smoke, smoke_arrivals=[1.0, 1.5])
    model = scenario.model
    workload = scenario.workload()
    placement = cores()
    os.sched_setaffinity(0, {placement["router and load client"]})
    results, runs = {}, {}
    for label, setup in SETUPS.items():
        with setup(model, placement) as (url, servers):
            outside = OutsideLoad(list(servers.values()))
            result, records = run_bench(url, "m", workload, progress=False)
            load = outside.measure()
            metrics = {
                role: _kv_metrics(server.base_url)
                for role, server in servers.items()
                if role != "router"
            }
        results[label] = {"engine_metrics": metrics, "cpu": load, **result}
        runs[label] = records
        print(f"{label:14s} {_cells(result)} {load}", flush=True)
    record = {
        "command": "python benchmarks/disaggregated.py" + (" --smoke" if args.smoke else ""),
        "machine": machine(),
        "model": scenario.size,
        "config": {
            "cores": placement,
            "flags": FLAGS,
            "why": "each engine gets one core and one torch thread, as if prefill and decode ran "
            "on different machines; the unified server decodes on the consumer's core and has "
            "no second core for prefill",
        },
        "workload": scenario.describe(),
        "finding": _finding(results),
        "results": results,
    }
    write_result("disaggregated", record, args.out_dir)
    plot_run(
        runs,
        workload.events,
        f"disaggregated, {scenario.size} model",
        args.out_dir / "disaggregated.png",
    )
    update_readme(
        args.readme,
        "disaggregated",
        f"### disaggregated ({scenario.size} model, {scenario.streams} steady streams, "
        f"{scenario.long_len[0]}-{scenario.long_len[1]}-token prompts at {scenario.arrivals} s, one core per engine)\n\n"
        + table(
            [
                "deployment",
                "steady ITL p50 / p99 before (ms)",
                "during arrivals (ms)",
                "p99 ratio",
                "long-prompt TTFT mean (ms)",
            ],
            [[label, *_cells(result)] for label, result in results.items()],
        )
        + f"\n\nUnified: one `tidegate serve` on core {placement['unified']} (auto chunks). "
        f"Disaggregated: producer on core {placement['producer']}, consumer on core "
        f"{placement['consumer']}, router and client on core {placement['router and load client']}"
        f"; every engine `--num-threads 1`.\n\n{record['finding']}"
        "\n\n![disaggregated](results/disaggregated.png)",
    )


def compare_encryption(args) -> None:
    """The disaggregated deployment with plain and with CURVE KV transfer, alternated."""
    scenario = stall_scenario(args.smoke, smoke_arrivals=[1.0, 1.5])
    workload = scenario.workload()
    placement = cores()
    os.sched_setaffinity(0, {placement["router and load client"]})
    with tempfile.TemporaryDirectory() as folder:
        key_dir = Path(folder) / "kv-curve"
        write_key_dir(key_dir)
        arms = {
            "none": (),
            "curve": ("--kv-encryption", "curve", "--kv-curve-key-dir", str(key_dir)),
        }
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for repeat in range(args.repeats):
            # ABBA...: neither arm always runs on the warmer machine.
            for arm in arms if repeat % 2 == 0 else reversed(arms):
                with disaggregated(scenario.model, placement, arms[arm]) as (url, servers):
                    outside = OutsideLoad(list(servers.values()))
                    result, _ = run_bench(url, "m", workload, progress=False)
                    load = outside.measure()
                    pulls = _pull_metrics(servers["consumer"].base_url)
                runs[arm].append({"cpu": load, "pulls": pulls, **result})
                print(f"{arm:6s} run {repeat}: {_encryption_cells(runs[arm][-1])}", flush=True)
        transport: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(3):
            for arm in arms:
                curve_keys = key_dir if arm == "curve" else None
                transport[arm].append(_transport_mib_per_s(curve_keys))
    summary = {arm: _encryption_summary(arm_runs) for arm, arm_runs in runs.items()}
    for arm in arms:
        summary[arm]["transport_mib_per_s"] = statistics.median(transport[arm])
    finding = _encryption_finding(summary, runs)
    command = "python benchmarks/disaggregated.py --kv-encryption"
    command += " --smoke" if args.smoke else ""
    command += f" --repeats {args.repeats}" if args.repeats != 2 else ""
    record = {
        "command": command,
        "machine": machine(),
        "model": scenario.size,
        "config": {"cores": placement, "flags": FLAGS, "kv_flags": {"curve": list(arms["curve"])}},
        "workload": scenario.describe(),
        "finding": finding,
        "summary": summary,
        "runs": runs,
        "transport_mib_per_s": transport,
    }
    write_result("disaggregated_encryption", record, args.out_dir)
    header = [
        "KV transfer",
        "output tok/s",
        "long-prompt TTFT mean (ms)",
        "steady ITL p50 / p99 (ms)",
        "pull mean (ms)",
        "one rank's pull, loopback (MiB/s)",
    ]
    rows = [[arm, *_summary_cells(summary[arm])] for arm in arms]
    update_readme(
        args.readme,
        "disaggregated_encryption",
        f"### disaggregated, KV transfer plain vs CURVE ({scenario.size} model, "
        f"medians of {args.repeats} alternated runs each)\n\n"
        + table(header, rows)
        + f"\n\n`{command}`. {finding}",
    )


def _pull_metrics(base_url: str) -> dict[str, float | None]:
    """The consumer's pulls: how many, their mean latency, bytes, and fallbacks."""
    values = scrape(base_url)
    count = values.get("tidegate:kv_transfer_latency_seconds_count")
    total = values.get("tidegate:kv_transfer_latency_seconds_sum")
    return {
        "count": count,
        "mean_ms": round(1000 * total / count, 1) if count and total is not None else None,
        "received_bytes": values.get("tidegate:kv_received_bytes_total"),
        "fallbacks": values.get("tidegate:kv_transfer_fallbacks_total"),
    }


def _encryption_cells(run: dict) -> str:
    ttft = lookup(run, "groups", "long", "ttft_ms", "mean")
    return (
        f"{run['output_token_throughput']} output tok/s, long TTFT {ttft} ms, "
        f"pull {run['pulls']['mean_ms']} ms, {run['cpu']}"
    )


def _encryption_summary(runs: list[dict]) -> dict[str, float | None]:
    """Medians over an arm's runs: a run that other processes slowed counts as one."""

    def median(*keys: str) -> float | None:
        values = [v for v in (lookup(run, *keys) for run in runs) if v is not None]
        return round(statistics.median(values), 3) if values else None

    return {
        "output_token_throughput": median("output_token_throughput"),
        "total_token_throughput": median("total_token_throughput"),
        "long_ttft_ms_mean": median("groups", "long", "ttft_ms", "mean"),
        "steady_itl_ms_p50": median("itl_ms", "p50"),
        "steady_itl_ms_p99": median("itl_ms", "p99"),
        "pull_ms_mean": median("pulls", "mean_ms"),
        "fallbacks": median("pulls", "fallbacks"),
    }


def _summary_cells(summary: dict) -> list[object]:
    itl = f"{summary['steady_itl_ms_p50']} / {summary['steady_itl_ms_p99']}"
    return [
        summary["output_token_throughput"],
        summary["long_ttft_ms_mean"],
        itl,
        summary["pull_ms_mean"],
        summary["transport_mib_per_s"],
    ]


def _encryption_finding(summary: dict, runs: dict) -> str:
    """The cost of CURVE in the numbers, and whether it stayed under 10% of throughput."""
    plain, curve = summary["none"], summary["curve"]

    def change(key: str) -> str:
        if not plain[key] or curve[key] is None:
            return "n/a"
        return f"{100 * (curve[key] / plain[key] - 1):+.1f}%"

    cost = None
    if plain["output_token_throughput"] and curve["output_token_throughput"]:
        cost = 100 * (1 - curve["output_token_throughput"] / plain["output_token_throughput"])
    verdict = "n/a" if cost is None else ("under" if cost < 10 else "NOT under")
    busy = max(
        100 * run["cpu"]["outside_cpu_s"] / run["duration_s"]
        for arm_runs in runs.values()
        for run in arm_runs
        if run["duration_s"]
    )
    quiet = "" if busy <= QUIET_PERCENT else " (NOT a quiet machine)"
    return (
        f"CURVE vs plain: output throughput {change('output_token_throughput')}, long-prompt "
        f"TTFT {change('long_ttft_ms_mean')}, steady ITL p50 {change('steady_itl_ms_p50')}, "
        f"mean pull {change('pull_ms_mean')} ({plain['pull_ms_mean']} -> "
        f"{curve['pull_ms_mean']} ms); one rank's 45 MiB pull over loopback "
        f"{plain['transport_mib_per_s']} -> {curve['transport_mib_per_s']} MiB/s. Verdict: the "
        f"throughput cost is {verdict} 10%. Other processes used at most {busy:.0f}% of a "
        f"core during a run{quiet}."
    )


def _transport_mib_per_s(key_dir: Path | None, pulls: int = 5) -> float:
    """MiB/s of one rank's pull of 45 MiB (the small model's KV of a 3,840-token prompt: 12
    layers, 4 KV heads of 64, bf16) from a producer rank in this process, over loopback; the
    median of `pulls`. Both ranks' ZMQ I/O threads share this process's core."""
    import msgspec
    import torch
    import zmq

    from tidegate.engine.kv_transfer.zmq_worker import ZmqConnectorWorker
    from tidegate.engine.messages import (
        KVConnectorMetadata,
        KVRecvDone,
        KVRecvSpec,
        KVWorkerConfig,
    )

    blocks, shape = 240, (240, 16, 4, 64)
    ctx = zmq.Context.instance()
    address = f"ipc://@bench-kv-{uuid.uuid4().hex}"
    events = ctx.socket(zmq.PULL)
    events.bind(address)
    ranks = {}
    for role in ("producer", "consumer"):
        config = KVWorkerConfig("zmq", role, 0, address, 60.0, str(key_dir or ""))
        ranks[role] = ZmqConnectorWorker(config, 0, 1, 4, torch.device("cpu"))
        make = torch.randn if role == "producer" else torch.zeros
        ranks[role].register_kv_caches(
            [(make(shape).bfloat16(), make(shape).bfloat16()) for _ in range(12)]
        )
    try:
        ids = list(range(blocks))
        ranks["producer"].update_pins({"t": ids}, [])
        seconds = []
        for pull in range(pulls + 1):  # the first connects: not timed
            spec = KVRecvSpec(f"r{pull}", "t", "127.0.0.1", [ranks["producer"].data_port], ids, ids)
            started = time.perf_counter()
            ranks["consumer"].handle(KVConnectorMetadata(recv=[spec]))
            assert events.poll(60_000), "the pull never ended"
            done = msgspec.msgpack.decode(events.recv(), type=KVRecvDone)
            assert done.ok, done.error
            if pull:
                seconds.append(time.perf_counter() - started)
            ranks["consumer"].handle(KVConnectorMetadata(discard=[spec.req_id]))
        size_mib = 12 * 2 * blocks * 16 * 4 * 64 * 2 / 2**20
        return round(size_mib / statistics.median(seconds), 1)
    finally:
        for rank in ranks.values():
            rank.shutdown()
        events.close(linger=0)


def _kv_metrics(base_url: str) -> dict[str, float]:
    values = scrape(base_url)
    return {name: values.get(f"tidegate:{name}") for name in KV_METRICS}


def _cells(result: dict) -> list[object]:
    arrival = result.get("arrival", {})

    def pair(window: str) -> str:
        return f"{lookup(arrival, window, 'p50')} / {lookup(arrival, window, 'p99')}"

    return [
        pair("steady_itl_before_ms"),
        pair("steady_itl_during_ms"),
        lookup(arrival, "p99_ratio_during_vs_before"),
        lookup(result, "groups", "long", "ttft_ms", "mean"),
    ]


def _finding(results: dict) -> str:
    """One sentence per deployment from the numbers, and whether disaggregated stayed flat."""

    def describe(label: str) -> str:
        arrival = results[label].get("arrival", {})
        before = lookup(arrival, "steady_itl_before_ms", "p99")
        during = lookup(arrival, "steady_itl_during_ms", "p99")
        ratio = lookup(arrival, "p99_ratio_during_vs_before")
        ttft = lookup(results[label], "groups", "long", "ttft_ms", "mean")
        times = f" ({ratio}x)" if ratio is not None else ""
        return (
            f"{label}: steady p99 ITL {before} ms before, {during} ms while long prompts "
            f"prefill{times}; long-prompt TTFT mean {ttft} ms"
        )

    ratio = lookup(results, "disaggregated", "arrival", "p99_ratio_during_vs_before")
    if ratio is None:
        verdict = "disaggregated: no ratio (the run was too short to measure one)"
    elif ratio <= FLAT_RATIO:
        verdict = f"the decode side stays flat (p99 ratio {ratio} <= {FLAT_RATIO})"
    else:
        verdict = f"the decode side is NOT flat (p99 ratio {ratio} > {FLAT_RATIO})"
    fallbacks = lookup(
        results, "disaggregated", "engine_metrics", "consumer", "kv_transfer_fallbacks_total"
    )
    if fallbacks:
        verdict += f"; the consumer computed {fallbacks:.0f} prompts itself (KV pull failed)"
    outside = {
        label: round(100 * result["cpu"]["outside_cpu_s"] / result["duration_s"])
        for label, result in results.items()
        if result["duration_s"]
    }
    quiet = "" if max(outside.values(), default=0) <= QUIET_PERCENT else " (NOT a quiet machine)"
    busy = ", ".join(f"{percent}% of a core during {label}" for label, percent in outside.items())
    return (
        f"{describe('disaggregated')}. {describe('unified')}. Verdict: {verdict}. "
        f"Other processes on the machine used {busy}{quiet}."
    )


if __name__ == "__main__":
    main()
