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

    python benchmarks/disaggregated.py            # writes results/disaggregated.{json,png}
"""

from __future__ import annotations

import contextlib
import os
import subprocess
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
def disaggregated(model: Path, placement: dict) -> Iterator[tuple[str, dict[str, LocalServer]]]:
    """Producer, consumer and the router in front of them (the client talks to the router)."""
    with on_core(placement["producer"]):
        producer = tidegate_server(model, *FLAGS["producer"])
    with on_core(placement["consumer"]):
        consumer = tidegate_server(model, *FLAGS["consumer"])
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
    args = scenario_parser(__doc__).parse_args()
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
