"""The router's own Prometheus metrics, under `tidegate:router_`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tidegate.engine.router.instances import InstancePool

PREFIX = "tidegate:router_"

# From a one-token prefill of a short prompt to a long generation on the decode leg.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    """Requests per leg and status, leg latency, prefill skips, endpoint picker answers, each
    backend's state, the requests held per pool, and the requests routed per role and track.

    `tidegate:router_pending_requests{pool}` is a gauge: the client requests this router
    holds right now because the pool had no healthy instance when they came
    (router/pending.py). They are not yet on any instance, so no engine metric counts them;
    across router replicas the demand is the sum. `pool` is the deployment's pool name:
    `prefill` and `decode` in P/D mode, `unified` in balancer mode (no --prefill). A value
    above 0 for a pool at zero replicas means scale it up; held requests leave the gauge
    when an instance turns healthy, when they time out or overflow (503), or when their
    client disconnects.
    """

    def __init__(
        self, pools: Sequence[InstancePool], held: Mapping[str, InstancePool] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Upstream requests by leg (prefill, decode, models) and HTTP status ('error' when "
            "no status came back).",
            labelnames=("leg", "code"),
            registry=self.registry,
        )
        self.latency = Histogram(
            PREFIX + "request_latency_seconds",
            "Seconds from sending a leg's request to the end of its response.",
            labelnames=("leg",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill_skipped = Counter(
            PREFIX + "prefill_skipped",
            "Requests sent straight to a decode instance (n > 1 or a batch of prompts).",
            registry=self.registry,
        )
        self.epp_picks = Counter(
            PREFIX + "epp_picks",
            "Endpoint picker (--epp-port) answers to a gateway by outcome: picked (endpoints "
            "returned), no_endpoint (503: no healthy instance, or none in the gateway's subset), "
            "shed (429, --epp-shed-load), tenant_limit (429, the tenant's requests in flight at its "
            "limit), unauthorized (401, no valid API key), error (400 for a body that is not JSON, a protocol "
            "violation, or a failure of the picker itself).",
            labelnames=("outcome",),
            registry=self.registry,
        )
        self.registry.register(_BackendCollector(pools, held or {}))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _BackendCollector(Collector):
    """Reads the pools at scrape time, so that instances dropped by discovery disappear."""

    def __init__(self, pools: Sequence[InstancePool], held: Mapping[str, InstancePool]) -> None:
        self._pools = pools
        self._held = held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            PREFIX + "backend_up",
            "1 while an instance passes its health checks.",
            labels=("role", "url"),
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "backend_in_flight",
            "Requests this router has in flight on an instance.",
            labels=("role", "url"),
        )
        for pool in self._pools:
            for instance in pool:
                up.add_metric((pool.role, instance.url), 1.0 if instance.healthy else 0.0)
                in_flight.add_metric((pool.role, instance.url), instance.in_flight)
        pending = GaugeMetricFamily(
            PREFIX + "pending_requests",
            "Requests held because the pool had no healthy instance when they came (its "
            "demand while at zero replicas).",
            labels=("pool",),
        )
        for name, pool in self._held.items():
            pending.add_metric((name,), pool.pending)
        routed = CounterMetricFamily(
            PREFIX + "routed_requests",
            "Requests routed to an instance of a role (first choices, not retries), by the "
            "instance's rollout track (stable, canary): a canary's share of its role's "
            "requests is its track's count over the role's.",
            labels=("role", "track"),
        )
        for pool in self._pools:
            for track, count in pool.routed_requests.items():
                routed.add_metric((pool.role, track), count)
        yield up
        yield in_flight
        yield pending
        yield routed
        yield from self._kv_index()

    def _kv_index(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """With --tokenizer: what the block index holds, and what routing by it achieved."""
        if not any(pool.index is not None for pool in self._pools):
            return
        blocks = GaugeMetricFamily(
            PREFIX + "kv_index_blocks",
            "KV blocks an instance holds, as its KV-cache events tell this router.",
            labels=("role", "url"),
        )
        synced = GaugeMetricFamily(
            PREFIX + "kv_index_synced",
            "1 once this router follows an instance's KV-cache events (its replay came).",
            labels=("role", "url"),
        )
        prompt = CounterMetricFamily(
            PREFIX + "routed_prompt_tokens",
            "Prompt tokens of the requests routed by held blocks (first choices).",
            labels=("role",),
        )
        cached = CounterMetricFamily(
            PREFIX + "routed_cached_tokens",
            "Of those, the tokens whose KV the chosen instance held: the prefix-cache hits "
            "routing expects.",
            labels=("role",),
        )
        for pool in self._pools:
            if pool.index is None:
                continue
            for instance in pool:
                held = pool.index.held.get(instance.url)
                if held is not None:
                    blocks.add_metric((pool.role, instance.url), held.num_blocks)
                    synced.add_metric((pool.role, instance.url), 1.0 if held.synced else 0.0)
            prompt.add_metric((pool.role,), pool.routed_prompt_tokens)
            cached.add_metric((pool.role,), pool.routed_cached_tokens)
        yield from (blocks, synced, prompt, cached)
