"""autoscaling: three fleets on one bursty trace, simulated request by request.

A fixed fleet of maxReplicas, a fixed fleet of minReplicas, and a pool that Tidegate's
autoscaler (`tidegate.operator.autoscaler.decide`, the operator's own function) sizes every
15 s. The capacities are the engine's, measured by other scenarios:

- a replica's output tokens/s at saturation: 257.52, `tidegate` at rate inf in
  `results/serving_vs_vllm.json` as recorded on an AVX2-only EPYC (small model, 2 cores;
  the file's git history: the run of 2026-12-02 on AVX-512 gave 336), shared by `--slots` running
  requests (16: the burst size of `results/executor_backend_small.json`);
- a pod's start time: 14.112 s, the small model's median seconds to healthy in
  `results/serve_startup.json` (a Kubernetes pod adds scheduling and image pulls: see
  `--start-s`);
- a request's prefill: 258 ms, the TTFT p50 at 1 req/s in that same run (193 ms in the later).

The queueing model: requests wait in one FCFS queue (the router's); a free slot of a ready
replica takes the next one; its TTFT is its wait plus the prefill, and it then holds the slot
for its output tokens at tokens/s / slots. A pod costs replica-seconds from the moment it is
asked for until it is gone; a pod scaled away first finishes what it runs.

    python benchmarks/autoscaling.py
    python benchmarks/autoscaling.py --smoke
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from common import machine, scenario_parser, table, update_readme, write_result
from tidegate.operator.autoscaler import PoolSignals, PoolTargets, ScalerState, decide
from tidegate.operator.spec import AutoscalingPolicy

TICK_S = 5.0  # how often the operator's loop decides (its default period)
# The policy for bursty traffic on pods that start in seconds: headroom (10 requests per
# replica of 16 slots), growth ahead of a rising demand, and a scale-down window of about
# two start times. The variants show what each choice buys.
POLICY = {
    "targets": {"requestsPerReplica": 10},
    "scaleUp": {"predictive": True},
    "scaleDown": {"stabilizationWindowSeconds": 30, "pods": 2, "percent": 50, "periodSeconds": 30},
}
VARIANTS = {
    "not predictive": {"scaleUp": {"predictive": False}},
    "scale-down window 60 s": {
        "scaleDown": {
            "stabilizationWindowSeconds": 60,
            "pods": 2,
            "percent": 50,
            "periodSeconds": 30,
        }
    },
    "requestsPerReplica 12": {"targets": {"requestsPerReplica": 12}},
    "the policy's defaults (requestsPerReplica 12)": {
        "targets": {"requestsPerReplica": 12},
        "scaleUp": {},
        "scaleDown": {},
    },
}
OTHER_SEEDS = (1, 2, 3)  # the same policy on other draws of the trace
LATENCY_WINDOW_S = 60.0  # the TTFTs a decision's p90 is taken over


@dataclass(frozen=True)
class Request:
    """One request of the trace."""

    arrival: float
    output_tokens: int


def bursty_trace(duration_s: float, seed: int) -> list[Request]:
    """A 1 req/s background with bursts of 4-10 req/s more: 30 s up, 1-3 min held, 30 s down.

    Bursts start as a Poisson process (one per 5 minutes on average); arrivals are Poisson
    at the summed rate (drawn by thinning).
    """
    rng = random.Random(seed)
    bursts, t = [], rng.expovariate(1 / 300)
    while t < duration_s:
        bursts.append((t, rng.uniform(4, 10), rng.uniform(60, 180)))
        t += rng.expovariate(1 / 300)

    def rate(at: float) -> float:
        total = 1.0
        for start, height, hold in bursts:
            x = at - start
            if 0 <= x < 30:
                total += height * x / 30
            elif 30 <= x < 30 + hold:
                total += height
            elif 30 + hold <= x < 60 + hold:
                total += height * (60 + hold - x) / 30
        return total

    peak = 1.0 + sum(height for _, height, _ in bursts)
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return requests
        if rng.random() < rate(t) / peak:
            requests.append(Request(t, rng.randint(64, 128)))


@dataclass
class Replica:
    """One pod: when it serves, what it runs, and when it is gone."""

    asked_at: float
    ready_at: float
    running: list[float] = field(default_factory=list)  # when each running request ends
    draining: bool = False
    gone_at: float | None = None


@dataclass
class Fleet:
    """The pods of one pool and the requests they serve, event by event."""

    slots: int
    tok_per_s: float
    start_s: float
    prefill_s: float
    replicas: list[Replica] = field(default_factory=list)
    queue: deque[Request] = field(default_factory=deque)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (first token at, TTFT)
    clock: float = 0.0  # the time of the last event run

    def add(self, now: float, count: int, start_s: float | None = None) -> None:
        """Ask for `count` pods; they serve `start_s` later."""
        start = self.start_s if start_s is None else start_s
        self.replicas += [Replica(now, now + start) for _ in range(count)]

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.gone_at is None and not r.draining]

    def remove(self, now: float, count: int) -> None:
        """Pods not ready go first, then the least busy ready ones, which finish their work."""
        live = sorted(self.live(), key=lambda r: (r.ready_at <= now, len(r.running)))
        for replica in live[:count]:
            replica.draining = True
            if replica.ready_at > now or not replica.running:
                replica.gone_at = now

    def run_until(self, now: float) -> None:
        """Finish and start requests up to `now`, in time order."""
        while True:
            ends = [
                (min(r.running), i)
                for i, r in enumerate(self.replicas)
                if r.running and r.gone_at is None
            ]
            free = [
                (r.ready_at, i)
                for i, r in enumerate(self.replicas)
                if r.gone_at is None and not r.draining and len(r.running) < self.slots
            ]
            next_free = min(free, default=None)
            next_end = min(ends, default=None)
            # A queued request starts when a slot is free and it has arrived.
            start_at = None
            if self.queue and next_free is not None:
                start_at = max(next_free[0], self.queue[0].arrival, self.clock)
            candidates = [c for c in (start_at, next_end and next_end[0]) if c is not None]
            if not candidates or min(candidates) > now:
                return
            if start_at is not None and (next_end is None or start_at <= next_end[0]):
                self.clock = start_at
                replica = self.replicas[next_free[1]]
                request = self.queue.popleft()
                ttft = start_at - request.arrival + self.prefill_s
                self.ttfts.append((start_at + self.prefill_s, ttft))
                seconds = self.prefill_s + request.output_tokens * self.slots / self.tok_per_s
                heapq.heappush(replica.running, start_at + seconds)
            else:
                self.clock = next_end[0]
                replica = self.replicas[next_end[1]]
                heapq.heappop(replica.running)
                if replica.draining and not replica.running:
                    replica.gone_at = next_end[0]

    def signals(self, now: float) -> PoolSignals:
        """What the operator would scrape at `now`."""
        live = self.live()
        ready = [r for r in live if r.ready_at <= now]
        running = sum(len(r.running) for r in ready)
        arrived = 0
        for request in self.queue:  # in arrival order
            if request.arrival > now:
                break
            arrived += 1
        recent = sorted(t for at, t in self.ttfts if now - LATENCY_WINDOW_S < at <= now)
        return PoolSignals(
            ready=len(ready),
            pending=len(live) - len(ready),
            running=running,
            waiting=arrived if ready else 0,
            kv_cache_usage=running / (len(ready) * self.slots) if ready else None,
            latency_p90_s=recent[int(0.9 * (len(recent) - 1))] if recent else None,
            router_pending=0 if ready else arrived,
            start_time_s=self.start_s,
        )

    def replica_seconds(self, end: float) -> float:
        """Seconds of every pod, from asked for to gone."""
        return sum(
            (r.gone_at if r.gone_at is not None else end) - r.asked_at for r in self.replicas
        )


def simulate(
    requests: list[Request],
    duration_s: float,
    fleet: Fleet,
    fixed: int | None,
    policy: AutoscalingPolicy,
    targets: PoolTargets,
) -> dict:
    """One fleet through the trace: fixed at `fixed` replicas, or autoscaled by `policy`."""
    first = fixed if fixed is not None else max(policy.min_replicas, 1)
    fleet.add(0.0, first, start_s=0.0)  # every fleet starts warm
    fleet.queue = deque(requests)
    state, now, events, replicas_over_time = ScalerState(), 0.0, [], []
    while now < duration_s:
        now += TICK_S
        fleet.run_until(now)
        if fixed is None:
            decision = decide(policy, targets, fleet.signals(now), state, now)
            state = decision.state
            if decision.changed:
                events.append({"at_s": now, "reason": decision.reason})
                if decision.desired > decision.current:
                    fleet.add(now, decision.desired - decision.current)
                else:
                    fleet.remove(now, decision.current - decision.desired)
        replicas_over_time.append(len(fleet.live()))
    fleet.run_until(math.inf)  # the requests still queued are served, late
    slo_s = targets.latency_slo_s or math.inf
    within = sum(1 for _, ttft in fleet.ttfts if ttft <= slo_s)
    ttfts = sorted(t for _, t in fleet.ttfts)
    return {
        "requests": len(ttfts),
        "within_ttft_slo": round(within / len(ttfts), 4),
        "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1),
        "ttft_p99_ms": round(ttfts[int(0.99 * (len(ttfts) - 1))] * 1000, 1),
        "replica_seconds": round(fleet.replica_seconds(duration_s), 1),
        "replicas_max": max(replicas_over_time),
        "replicas_mean": round(sum(replicas_over_time) / len(replicas_over_time), 2),
        "scale_events": len(events),
        "events": events[:40],
    }


def _policy(args, overrides: dict | None = None) -> AutoscalingPolicy:
    """POLICY within the bounds given, with `overrides` replacing whole sections."""
    spec = {"minReplicas": args.min_replicas, "maxReplicas": args.max_replicas, **POLICY}
    return AutoscalingPolicy.model_validate({**spec, **(overrides or {})})


def _targets(policy: AutoscalingPolicy, ttft_slo_ms: int) -> PoolTargets:
    assert policy.targets.requests_per_replica is not None
    return PoolTargets(
        requests_per_replica=policy.targets.requests_per_replica,
        waiting_per_replica=policy.targets.waiting_requests_per_replica,
        kv_cache_usage=policy.targets.kv_cache_usage_percent / 100,
        latency_slo_s=ttft_slo_ms / 1000,
    )


def _summary(run: dict, max_fleet: dict) -> dict:
    return {
        "within_ttft_slo": run["within_ttft_slo"],
        "replica_seconds_share": round(run["replica_seconds"] / max_fleet["replica_seconds"], 3),
        "scale_events": run["scale_events"],
    }


def _met(run: dict, max_fleet: dict) -> bool:
    share = run["replica_seconds"] / max_fleet["replica_seconds"]
    return run["within_ttft_slo"] >= 0.95 and share <= 0.60


def main() -> None:
    parser = scenario_parser(__doc__.splitlines()[0])
    parser.add_argument("--tok-per-s", type=float, default=257.52, help="per replica, saturated")
    parser.add_argument("--slots", type=int, default=16, help="running requests per replica")
    parser.add_argument("--start-s", type=float, default=14.112, help="pod start time")
    parser.add_argument("--prefill-ms", type=float, default=258.0)
    parser.add_argument("--ttft-slo-ms", type=int, default=800, help="the spec's default")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=7200.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    duration = 900.0 if args.smoke else args.duration_s
    requests = bursty_trace(duration, args.seed)
    policy = _policy(args)

    def run(trace: list[Request], fixed: int | None, chosen: AutoscalingPolicy) -> dict:
        fleet = Fleet(args.slots, args.tok_per_s, args.start_s, args.prefill_ms / 1000)
        return simulate(trace, duration, fleet, fixed, chosen, _targets(chosen, args.ttft_slo_ms))

    fleets = {
        f"fixed max ({args.max_replicas})": args.max_replicas,
        f"fixed min ({args.min_replicas})": args.min_replicas,
        "autoscaler": None,
    }
    results = {}
    for name, fixed in fleets.items():
        results[name] = run(requests, fixed, policy)
        print(
            f"{name}: {results[name]['within_ttft_slo']:.1%} within the TTFT SLO, "
            f"{results[name]['replica_seconds']:.0f} replica-seconds"
        )
    max_fleet = results[f"fixed max ({args.max_replicas})"]
    variants = {
        name: _summary(run(requests, None, _policy(args, overrides)), max_fleet)
        for name, overrides in VARIANTS.items()
    }
    other_traces = {}
    for seed in () if args.smoke else OTHER_SEEDS:
        trace = bursty_trace(duration, seed)
        fixed_max = run(trace, args.max_replicas, policy)
        auto_run, plain = (
            run(trace, None, policy),
            run(trace, None, _policy(args, VARIANTS["not predictive"])),
        )
        other_traces[f"seed {seed}"] = {
            "requests": len(trace),
            "autoscaler": {
                **_summary(auto_run, fixed_max),
                "target_met": _met(auto_run, fixed_max),
            },
            "not predictive": _summary(plain, fixed_max),
        }
    auto = results["autoscaler"]
    share = auto["replica_seconds"] / max_fleet["replica_seconds"]
    met = _met(auto, max_fleet)
    verdict = (
        f"autoscaler: {auto['within_ttft_slo']:.1%} of requests within the "
        f"{args.ttft_slo_ms} ms TTFT SLO (target >= 95%) at {share:.0%} of the fixed max "
        f"fleet's replica-seconds (target <= 60%): {'met' if met else 'not met'}"
    )
    if other_traces:
        held = sum(1 for t in other_traces.values() if t["autoscaler"]["target_met"])
        verdict += f"; on {held} of {len(other_traces)} other draws of the trace"
    print(verdict)
    record = {
        "command": "python benchmarks/autoscaling.py" + (" --smoke" if args.smoke else ""),
        "machine": machine(),
        "capacities": {
            "output_tok_per_s_per_replica": args.tok_per_s,
            "slots_per_replica": args.slots,
            "start_s": args.start_s,
            "prefill_ms": args.prefill_ms,
            "from": "results/serving_vs_vllm.json (tidegate, rate inf, small model: output "
            "tok/s; TTFT p50 at 1 req/s), results/serve_startup.json (small, median seconds "
            "to healthy), results/executor_backend_small.json (16-request burst)",
        },
        "trace": {
            "kind": "bursty: 1 req/s background, Poisson bursts of +4-10 req/s every 5 min "
            "on average (30 s ramps, 1-3 min held), 64-128 output tokens",
            "duration_s": duration,
            "seed": args.seed,
            "requests": len(requests),
        },
        "decision_period_s": TICK_S,
        "policy": policy.model_dump(by_alias=True),
        "ttft_slo_ms": args.ttft_slo_ms,
        "results": results,
        "variants": variants,
        "other_traces": other_traces,
        "autoscaler_replica_seconds_share": round(share, 3),
        "target_met": met,
        "verdict": verdict,
    }
    print(f"wrote {write_result('autoscaling', record, args.out_dir)}")
    rows = [
        [
            name,
            f"{r['within_ttft_slo']:.1%}",
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["replica_seconds"],
            r["replicas_mean"],
            r["scale_events"],
        ]
        for name, r in results.items()
    ]
    summary_header = ["", "within TTFT SLO", "replica-seconds / fixed max", "scale events"]

    def summary_row(name: str, r: dict) -> list:
        return [name, f"{r['within_ttft_slo']:.1%}", f"{r['replica_seconds_share']:.0%}",
                r["scale_events"]]  # fmt: skip

    text = (
        f"### autoscaling (simulated: {len(requests)} requests of a bursty trace over "
        f"{duration:.0f} s, capacities measured from the engine)\n\n"
        + table(
            [
                "fleet",
                "within TTFT SLO",
                "TTFT p50 (ms)",
                "TTFT p99 (ms)",
                "replica-seconds",
                "mean replicas",
                "scale events",
            ],
            rows,
        )
        + f"\n\n{verdict}.\n\nThe autoscaler with one choice of its policy changed:\n\n"
        + table(summary_header, [summary_row(n, r) for n, r in variants.items()])
    )
    if other_traces:
        text += (
            "\n\nThe same policy on other draws of the trace (seed), and without prediction:\n\n"
        )
        text += table(
            summary_header,
            [
                summary_row(f"{name}{suffix}", t[kind])
                for name, t in other_traces.items()
                for kind, suffix in (("autoscaler", ""), ("not predictive", ", not predictive"))
            ],
        )
    text += (
        "\n\n`python benchmarks/autoscaling.py`: a replica serves "
        f"{args.tok_per_s} output tok/s over {args.slots} slots and starts in {args.start_s} s "
        "(results/serving_vs_vllm.json, results/serve_startup.json); the autoscaler decides "
        f"every {TICK_S:.0f} s with minReplicas {args.min_replicas}, maxReplicas "
        f"{args.max_replicas} and the policy in the script's POLICY: requestsPerReplica 10, "
        "predictive growth, scale-down window 30 s, 2 pods or 50% per 30 s."
    )
    update_readme(args.readme, "autoscaling", text)


if __name__ == "__main__":
    main()
