"""kv-routing: routing by the blocks each engine holds, against rendezvous hashing.

Three `tidegate serve` instances behind one `tidegate router`; the same workload twice per
round, with a fresh set of instances each time (empty caches):

- rendezvous: the router as it was, hashing the prompt's leading text (no --tokenizer);
- kv-blocks: the router follows every instance's KV-cache events (--kv-events-port 0 on the
  engines, --tokenizer on the router) and sends each request where the longest prefix of
  its blocks is held, weighed against load.

The workload is multi-tenant: every tenant's system prompt opens with the same platform
preamble (a policy text every tenant carries, longer than the router's rendezvous key),
then the tenant's own instructions, then the user's question. Requests arrive as a Poisson
stream at a rate the three instances serve without queueing much. Reported, per router:
prompt tokens served from cache (the engines' prefix-cache hits) and computed, and TTFT;
the median over rounds, the two routers alternating within each round.

    python benchmarks/kv_routing.py                 # writes results/kv_routing.json
    python benchmarks/kv_routing.py --smoke         # tiny model, one round, seconds
"""

from __future__ import annotations

import contextlib
import random
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from common import (
    machine,
    model_dir,
    scenario_parser,
    scrape,
    table,
    tidegate_server,
    update_readme,
    write_result,
)
from tidegate.common.local_server import LocalServer
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import BenchRequest, Workload

NUM_INSTANCES = 3
# Each engine gets one torch thread: three instances share this machine's two cores.
ENGINE_FLAGS = ["--num-threads", "1", "--max-model-len", "2048"]
EVENTS_FLAGS = ["--kv-events-port", "0"]  # each instance names its port in /metrics
ROUTERS = ("rendezvous", "kv-blocks")
TOKEN_RANGE = (100, 1000)  # inside every tiny model's vocabulary (1,024 at the smallest)


def tenants_workload(
    num_requests: int,
    num_tenants: int,
    preamble_len: int,
    tenant_len: int,
    question_len: tuple[int, int],
    output_len: int,
    rate: float,
    seed: int,
) -> Workload:
    """Tenants whose prompts share a preamble, then their own text, then a question."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    preamble = tokens(preamble_len)
    tenants = [preamble + tokens(tenant_len) for _ in range(num_tenants)]
    requests, at = [], 0.0
    for _ in range(num_requests):
        at += rng.expovariate(rate)
        tenant = rng.randrange(num_tenants)
        requests.append(
            BenchRequest(
                prompt=tenants[tenant] + tokens(rng.randint(*question_len)),
                max_tokens=output_len,
                group=f"tenant-{tenant}",
                send_at=at,
            )
        )
    return Workload("tenants", requests)


@contextlib.contextmanager
def deployment(model: Path, router: str, num_blocks: int) -> Iterator[tuple[str, list[str]]]:
    """Three fresh instances and a router; yields the router's URL and the instances'."""
    flags = [*ENGINE_FLAGS, "--num-gpu-blocks", str(num_blocks)]
    if router == "kv-blocks":
        flags += EVENTS_FLAGS
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(tidegate_server(model, *flags)) for _ in range(NUM_INSTANCES)
        ]
        for server in servers:
            server.wait_healthy()
        urls = [server.base_url for server in servers]
        router_flags = ["--health-interval", "0.5"]
        if router == "kv-blocks":
            router_flags += ["--tokenizer", str(model)]
        proxy = stack.enter_context(
            LocalServer.tidegate_router([], urls, *router_flags, log=subprocess.DEVNULL)
        )
        proxy.wait_healthy()
        time.sleep(1.5)  # a few health rounds: loads, and the event subscriptions, in place
        yield proxy.base_url, urls


def totals(urls: list[str]) -> dict[str, float]:
    """Prompt tokens the instances were asked for, served from cache, and computed."""
    pages = [scrape(url) for url in urls]
    return {
        "prompt_tokens": sum(p.get("tidegate:prompt_tokens_total", 0) for p in pages),
        "cached_tokens": sum(p.get("tidegate:prefix_cache_hits_total", 0) for p in pages),
        "computed_tokens": sum(p.get("tidegate:prompt_tokens_computed_total", 0) for p in pages),
    }


def main() -> None:
    args = scenario_parser(__doc__).parse_args()
    smoke = args.smoke
    size = "tiny" if smoke else "small"
    model = model_dir(size)
    rounds = 1 if smoke else 3
    spec = dict(
        num_requests=24 if smoke else 120,
        num_tenants=6,
        preamble_len=256,
        tenant_len=512,
        question_len=(16, 64),
        output_len=16,
        rate=4.0 if smoke else 1.5,
        seed=0,
    )
    workload = tenants_workload(**spec)  # type: ignore[arg-type]
    # Room for a few tenants' prompts per instance, not all six: where a tenant's blocks
    # are held matters.
    num_blocks = 160
    runs: dict[str, list[dict]] = {name: [] for name in ROUTERS}
    for round_index in range(rounds):
        order = ROUTERS if round_index % 2 == 0 else ROUTERS[::-1]
        for name in order:
            with deployment(model, name, num_blocks) as (url, urls):
                result, _ = run_bench(url, "m", workload, progress=False)
                counts = totals(urls)
            if result["failed"]:
                raise SystemExit(f"{name}: {result['failed']} requests failed: {result['errors']}")
            # Of the prompt tokens the engines prefilled, those read from cache. A preempted
            # request prefills again (more hits, or more computed tokens): the share is of
            # that work, not of the prompts' length.
            work = counts["cached_tokens"] + counts["computed_tokens"]
            counts["cached_fraction"] = round(counts["cached_tokens"] / work, 3)
            run = {
                "cached": counts,
                "ttft_ms": result["ttft_ms"],
                "completed": result["completed"],
                "load_average_1m": round(__import__("os").getloadavg()[0], 2),
            }
            runs[name].append(run)
            print(f"round {round_index} {name:10s} cached {counts['cached_fraction']:.3f} "
                  f"ttft p50 {result['ttft_ms']['p50']:.0f} ms", flush=True)  # fmt: skip

    def median(name: str, *keys: str) -> float:
        values = []
        for run in runs[name]:
            value: object = run
            for key in keys:
                value = value[key]  # type: ignore[index]
            values.append(float(value))  # type: ignore[arg-type]
        return round(statistics.median(values), 3)

    summary = {
        name: {
            "cached_fraction": median(name, "cached", "cached_fraction"),
            "computed_tokens": median(name, "cached", "computed_tokens"),
            "ttft_p50_ms": median(name, "ttft_ms", "p50"),
            "ttft_p90_ms": median(name, "ttft_ms", "p90"),
        }
        for name in ROUTERS
    }
    kv, rv = summary["kv-blocks"], summary["rendezvous"]
    finding = (
        f"kv-blocks serves {kv['cached_fraction']:.0%} of prompt tokens from cache against "
        f"rendezvous's {rv['cached_fraction']:.0%}; TTFT p50 {kv['ttft_p50_ms']:.0f} ms against "
        f"{rv['ttft_p50_ms']:.0f} ms (median of {rounds} alternating rounds)"
    )
    record = {
        "command": "python benchmarks/kv_routing.py" + (" --smoke" if smoke else ""),
        "machine": machine(),
        "model": size,
        "config": {
            "instances": NUM_INSTANCES,
            "engine_flags": ENGINE_FLAGS,
            "num_gpu_blocks": num_blocks,
            "workload": spec,
        },
        "finding": finding,
        "summary": summary,
        "runs": runs,
    }
    write_result("kv_routing", record, args.out_dir)
    rows = [
        [
            name,
            f"{summary[name]['cached_fraction']:.0%}",
            f"{summary[name]['computed_tokens']:.0f}",
            f"{summary[name]['ttft_p50_ms']:.0f}",
            f"{summary[name]['ttft_p90_ms']:.0f}",
        ]
        for name in ROUTERS
    ]
    markdown = "\n".join(
        [
            f"`{record['command']}` ({size} model, {NUM_INSTANCES} instances, {rounds} rounds): "
            + finding
            + ".",
            "",
            table(
                ["router", "prompt tokens cached", "computed", "TTFT p50 ms", "TTFT p90 ms"], rows
            ),
        ]
    )
    if not smoke:
        update_readme(args.readme, "kv-routing", markdown)
    print(finding)


if __name__ == "__main__":
    main()
