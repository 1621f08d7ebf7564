"""A pool's load from its pods' `/metrics` and the router's: what the autoscaler decides on.

The engine exports, per engine core (`engine="<i>"` with data parallelism):
`tidegate:num_requests_running`, `tidegate:num_requests_waiting`, `tidegate:kv_cache_usage_perc`
(gauges) and the `tidegate:time_to_first_token_seconds` and
`tidegate:inter_token_latency_seconds` histograms, and with LoRA on
`tidegate:lora_adapter_ready{adapter} 1` for each adapter the pod serves now; the router exports
`tidegate:router_pending_requests{pool}`, the requests it holds while a pool has no ready
instance. Histograms are cumulative since the pod started, so a latency is read from the
difference between two scrapes: the p90 of the requests of the last period, not of the
pod's whole life.

Pure functions of exposition text: the operator's loops and `tidegate up` fetch the text
their own way (aiohttp in the cluster, a thread with httpx on one machine) and share these.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tidegate.operator.autoscaler import PoolSignals

RUNNING = "tidegate:num_requests_running"
WAITING = "tidegate:num_requests_waiting"
KV_USAGE = "tidegate:kv_cache_usage_perc"
TTFT = "tidegate:time_to_first_token_seconds"
ITL = "tidegate:inter_token_latency_seconds"
ROUTER_PENDING = "tidegate:router_pending_requests"
LORA_ADAPTER_READY = "tidegate:lora_adapter_ready"
FINISHED = "tidegate:request_success_total"

# name{labels} value [timestamp]; labels as Prometheus writes them (escaped quotes allowed).
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_exposition(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; comments and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        found = {key: _unescape(raw) for key, raw in _LABEL.findall(labels or "")}
        samples.append(Sample(name, found, number))
    return samples


def _unescape(raw: str) -> str:
    return raw.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


@dataclass(frozen=True)
class EngineLoad:
    """One engine pod's load, summed over its engine cores."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None  # the fullest engine core's, 0 to 1
    # Cumulative bucket counts by upper bound (`le`), of TTFT and of ITL.
    ttft_buckets: Mapping[float, float] = field(default_factory=dict)
    itl_buckets: Mapping[float, float] = field(default_factory=dict)
    # Requests finished since the pod started, and those of them that failed.
    finished: float = 0.0
    failed: float = 0.0


def engine_load(samples: Iterable[Sample]) -> EngineLoad:
    """An engine pod's load from its samples (those of one scrape of its `/metrics`)."""
    running = waiting = finished = failed = 0.0
    usage: list[float] = []
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    for sample in samples:
        if sample.name == RUNNING:
            running += sample.value
        elif sample.name == WAITING:
            waiting += sample.value
        elif sample.name == KV_USAGE:
            usage.append(sample.value)
        elif sample.name == FINISHED:
            finished += sample.value
            if sample.labels.get("finished_reason") == "error":
                failed += sample.value
        elif sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in buckets:
            bound = float(sample.labels.get("le", "+Inf"))
            histogram = buckets[sample.name[: -len("_bucket")]]
            histogram[bound] = histogram.get(bound, 0.0) + sample.value
    return EngineLoad(
        running=round(running),
        waiting=round(waiting),
        kv_cache_usage=max(usage) if usage else None,
        ttft_buckets=buckets[TTFT],
        itl_buckets=buckets[ITL],
        finished=finished,
        failed=failed,
    )


def router_pending(samples: Iterable[Sample], pool: str) -> int:
    """The requests a router holds for `pool` (0 when it exports no such series)."""
    return round(
        sum(s.value for s in samples if s.name == ROUTER_PENDING and s.labels.get("pool") == pool)
    )


def served_adapters(samples: Iterable[Sample]) -> frozenset[str]:
    """The LoRA adapters an engine pod serves: those `tidegate:lora_adapter_ready` says 1 for.

    An adapter the engine does not serve has no series at all; should a series carry another
    label (say, one per engine core), every one of the adapter's series must say 1.
    """
    values: dict[str, list[float]] = {}
    for sample in samples:
        adapter = sample.labels.get("adapter")
        if sample.name == LORA_ADAPTER_READY and adapter is not None:
            values.setdefault(adapter, []).append(sample.value)
    return frozenset(name for name, found in values.items() if all(v == 1 for v in found))


def increase(before: Mapping[float, float], after: Mapping[float, float]) -> dict[float, float]:
    """The observations between two scrapes of a cumulative histogram, by bucket bound; a
    counter that went down (the pod restarted) counts from zero, as PromQL's increase()."""
    if any(count < before.get(bound, 0.0) for bound, count in after.items()):
        return dict(after)
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated within its bucket as PromQL's
    histogram_quantile; None when it holds no observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound, as PromQL
            width = count - lower_count
            share = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def _sum_buckets(histograms: Iterable[Mapping[float, float]]) -> dict[float, float]:
    total: dict[float, float] = {}
    for histogram in histograms:
        for bound, count in histogram.items():
            total[bound] = total.get(bound, 0.0) + count
    return total


@dataclass
class PoolReading:
    """What the autoscaler scraped from one pool in one period, and what it keeps between
    periods: each pod's last histograms, so that latency is that of the period."""

    previous: dict[str, EngineLoad] = field(default_factory=dict)

    def signals(
        self,
        role: str,
        loads: Mapping[str, EngineLoad],
        pending: int,
        router_held: int = 0,
        start_time_s: float | None = None,
        rollout: bool = False,
    ) -> PoolSignals:
        """The pool's PoolSignals from the loads of its ready pods (by pod name)."""
        usage = [load.kv_cache_usage for load in loads.values() if load.kv_cache_usage is not None]
        # Latency of the period: each pod's increase since the last scrape, summed.
        histogram = "itl_buckets" if role == "decode" else "ttft_buckets"
        period = _sum_buckets(
            increase(getattr(self.previous[name], histogram), getattr(load, histogram))
            for name, load in loads.items()
            if name in self.previous
        )
        self.previous = dict(loads)
        return PoolSignals(
            ready=len(loads),
            pending=pending,
            running=sum(load.running for load in loads.values()),
            waiting=sum(load.waiting for load in loads.values()),
            kv_cache_usage=sum(usage) / len(usage) if usage else None,
            latency_p90_s=quantile(period, 0.9),
            router_pending=router_held,
            rollout=rollout,
            start_time_s=start_time_s,
        )
