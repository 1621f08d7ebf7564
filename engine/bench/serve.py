"""`tidegate bench serve`: drive any OpenAI-compatible server with a workload, report latency."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tidegate.engine.bench.load import RequestRecord, run_load
from tidegate.engine.bench.report import arrival_windows, parse_slo, summarize
from tidegate.engine.bench.workloads import (
    Workload,
    long_prompt_arrival_workload,
    parse_range,
    random_workload,
    shared_prefix_workload,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tidegate bench serve`."""
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument(
        "--workload", choices=["random", "shared-prefix", "long-prompt-arrival"], default="random"
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s or inf")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--slo", default=None, help="e.g. ttft_ms=800,itl_ms=50")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument("--plot", type=Path, default=None, help="PNG plot file")
    parser.add_argument("--token-range", default="10-999", help="prompt token ids LOW-HIGH")
    parser.add_argument("--extra-body", default="{}", help="JSON merged into every request")
    random_group = parser.add_argument_group("random and shared-prefix")
    random_group.add_argument("--input-len", default="128", help="N or LOW-HIGH")
    random_group.add_argument("--output-len", default="64", help="N or LOW-HIGH")
    random_group.add_argument("--num-prefixes", type=int, default=1)
    random_group.add_argument("--prefix-len", type=int, default=1000)
    random_group.add_argument("--suffix-len", default="16-64", help="N or LOW-HIGH")
    arrival = parser.add_argument_group("long-prompt-arrival")
    arrival.add_argument("--steady-streams", type=int, default=16)
    arrival.add_argument("--steady-input-len", type=int, default=64)
    arrival.add_argument("--steady-output-len", type=int, default=400)
    arrival.add_argument("--long-input-len", default="2048-4096", help="N or LOW-HIGH")
    arrival.add_argument(
        "--long-arrivals", default="4,7", help="seconds after the start, comma-separated"
    )
    arrival.add_argument("--long-output-len", type=int, default=8)


def build_workload(ns: argparse.Namespace) -> Workload:
    """The workload the flags describe (seeded: the same flags give the same requests)."""
    token_range = parse_range(ns.token_range)
    token_range = (token_range[0], token_range[1] + 1)
    if ns.workload == "random":
        return random_workload(
            ns.num_prompts,
            parse_range(ns.input_len),
            parse_range(ns.output_len),
            ns.seed,
            token_range,
        )
    if ns.workload == "shared-prefix":
        return shared_prefix_workload(
            ns.num_prompts,
            ns.num_prefixes,
            ns.prefix_len,
            parse_range(ns.suffix_len),
            parse_range(ns.output_len),
            ns.seed,
            token_range,
        )
    arrivals = [float(at) for at in ns.long_arrivals.split(",") if at]
    return long_prompt_arrival_workload(
        ns.steady_streams,
        ns.steady_input_len,
        ns.steady_output_len,
        parse_range(ns.long_input_len),
        arrivals,
        ns.long_output_len,
        ns.seed,
        token_range,
    )


def result_of(
    workload: Workload, records: list[RequestRecord], duration: float, slo: dict[str, float]
) -> dict:
    """The summary of one run, with per-group summaries and the arrival windows if any."""
    result = summarize(records, duration, slo)
    groups = sorted({r.group for r in records})
    if len(groups) > 1 and workload.name != "shared-prefix":
        result["groups"] = {
            group: summarize([r for r in records if r.group == group], duration, slo)
            for group in groups
        }
    if workload.events:
        result["arrival"] = arrival_windows(records, workload.events)
    return result


def run_bench(
    base_url: str,
    model: str,
    workload: Workload,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    slo: dict[str, float] | None = None,
    extra_body: dict | None = None,
    progress: bool = True,
) -> tuple[dict, list[RequestRecord]]:
    """Run one workload against one server; returns (result, records)."""
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(workload.requests), desc=workload.name, file=sys.stderr)
        except ImportError:
            bar = None
    records, duration = asyncio.run(
        run_load(
            base_url,
            model,
            workload,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            seed=seed,
            api_key=api_key,
            extra_body=extra_body,
            on_done=(lambda _record: bar.update(1)) if bar is not None else None,
        )
    )
    if bar is not None:
        bar.close()
    return result_of(workload, records, duration, slo or {}), records


def main(ns: argparse.Namespace) -> int:
    """Entry point of `tidegate bench serve`."""
    workload = build_workload(ns)
    result, records = run_bench(
        ns.base_url,
        ns.model,
        workload,
        request_rate=ns.request_rate,
        max_concurrency=ns.max_concurrency,
        seed=ns.seed,
        api_key=ns.api_key,
        slo=parse_slo(ns.slo),
        extra_body=json.loads(ns.extra_body),
    )
    record = {
        "benchmark": "serve",
        "config": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(ns).items()
            if key != "handler"
        },
        "result": result,
    }
    record["config"]["request_rate"] = str(ns.request_rate)
    text = json.dumps(record, indent=2)
    print(text)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text + "\n")
    if ns.plot:
        from tidegate.engine.bench.plot import plot_run

        plot_run({ns.base_url: records}, workload.events, f"{workload.name} on {ns.model}", ns.plot)
    return 0 if result["failed"] == 0 else 1
