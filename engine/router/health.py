"""The background loop: re-resolve every URL, check every instance, read its load and adapters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import httpx

from tidegate.engine.config import DEFAULT_CANARY_WEIGHT
from tidegate.engine.router.adapters import ADAPTER_METRICS, read_adapters
from tidegate.engine.router.discovery import discover
from tidegate.engine.router.exposition import Exposition, parse_exposition
from tidegate.engine.router.instances import CANARY, STABLE, Instance, InstancePool

logger = logging.getLogger("tidegate.router")

# Engine gauges whose sum is the work an instance has queued (every series: one per core).
LOAD_METRICS = ("tidegate:num_requests_running", "tidegate:num_requests_waiting")
# The port an instance publishes KV-cache events on, as the label of an info gauge.
KV_EVENTS_METRIC = "tidegate:kv_events_info"
# An instance's rollout track and, for a canary, its share of requests, as an info gauge's labels.
REVISION_METRIC = "tidegate:revision_info"
# All the router reads of a /metrics page; the rest of it is not parsed.
READ_METRICS = frozenset((*LOAD_METRICS, *ADAPTER_METRICS, KV_EVENTS_METRIC, REVISION_METRIC))
# While requests are held for a pool with no healthy instance, rounds come this often (or
# more often, with a shorter --health-interval): a held request is routed within this
# much of its instance turning ready.
HOLDING_INTERVAL_S = 0.25


def reported_load(exposition: str | Exposition) -> float:
    """Running plus waiting requests in an engine's /metrics (text or parsed), over all series."""
    page = parse_exposition(exposition) if isinstance(exposition, str) else exposition
    # A NaN would make every load comparison false and no instance choosable.
    return sum(
        sample.value
        for sample in page.samples
        if sample.name in LOAD_METRICS and math.isfinite(sample.value)
    )


def kv_events_port(page: Exposition) -> int | None:
    """The KV-events port an instance's /metrics names, if any."""
    for sample in page.samples:
        if sample.name == KV_EVENTS_METRIC:
            port = sample.labels.get("port", "")
            if port.isdigit() and 0 < int(port) < 65536:
                return int(port)
    return None


def revision(page: Exposition) -> tuple[str, float | None]:
    """An instance's track and, for a canary, its weight, as its /metrics says.

    No series, or a track the router does not know: stable (a plain vLLM server, an older
    engine). A canary whose weight is missing or not strictly between 0 and 1 takes the
    engine's default weight, as an engine started without --traffic-weight does.
    """
    for sample in page.series(REVISION_METRIC):
        if sample.labels.get("track") != CANARY:
            continue
        try:
            weight = float(sample.labels.get("traffic_weight", ""))
        except ValueError:
            weight = DEFAULT_CANARY_WEIGHT
        if not 0.0 < weight < 1.0:  # NaN too
            weight = DEFAULT_CANARY_WEIGHT
        return CANARY, weight
    return STABLE, None


class HealthMonitor:
    """Every `interval` seconds: discovery, then GET /health (and /metrics) on each instance.

    /metrics gives an instance's load, its LoRA adapters (router/adapters.py), its KV-events
    port and its rollout track (`revision`), all read from one scrape.

    While any request is held (router/pending.py), rounds come every HOLDING_INTERVAL_S, and
    `wake` starts one at once.
    """

    def __init__(
        self,
        pools: dict[str, InstancePool],
        seeds: dict[str, Sequence[str]],
        client: httpx.AsyncClient,
        interval: float,
        connect_timeout: float,
        keep_single_name: bool = True,
    ) -> None:
        self.pools = pools
        self.seeds = seeds
        # False for an endpoint picker, whose endpoints must be addresses (discovery.py).
        self.keep_single_name = keep_single_name
        self.client = client
        self.interval = interval
        # A check slower than a round would delay the next round for every instance; a
        # /health that takes seconds to answer is a sick instance anyway.
        read_s = max(connect_timeout, min(interval, 10.0))
        self.timeout = httpx.Timeout(read_s, connect=connect_timeout)
        self._expanded: dict[str, dict[str, list[str]]] = {role: {} for role in pools}
        self._woken = asyncio.Event()
        # Awaited after every round: the endpoint picker's gRPC health follows the pools.
        self.on_round: Callable[[], Awaitable[None]] | None = None

    def wake(self) -> None:
        """Start the next round now (a request has started waiting for an instance)."""
        self._woken.set()

    async def run_round(self) -> None:
        """One round: update every pool's membership, then check all instances at once."""
        for role, pool in self.pools.items():
            self._expanded[role] = await discover(
                self.seeds[role], self._expanded[role], self.keep_single_name
            )
            pool.set_urls(url for urls in self._expanded[role].values() for url in urls)
        checks = [self._check(pool, instance) for pool in self.pools.values() for instance in pool]
        await asyncio.gather(*checks)
        indexes = {id(pool.index): pool.index for pool in self.pools.values() if pool.index}
        for index in indexes.values():
            # Every instance discovered, on the events port its last /metrics named.
            index.track({i.url: i.kv_events_port for pool in self.pools.values() for i in pool})
        if self.on_round is not None:
            await self.on_round()

    async def run(self) -> None:
        """Check forever, one round every `interval` seconds (until cancelled)."""
        while True:
            holding = any(pool.pending for pool in self.pools.values())
            interval = min(self.interval, HOLDING_INTERVAL_S) if holding else self.interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), interval)
            self._woken.clear()
            try:
                await self.run_round()
            except Exception:
                # A bug in one round must not stop health checking for good.
                logger.exception("health check round failed")

    async def _check(self, pool: InstancePool, instance: Instance) -> None:
        try:
            response = await self.client.get(instance.endpoint("/health"), timeout=self.timeout)
        except httpx.HTTPError as error:
            pool.mark_down(instance, f"GET /health failed: {error!r}")
            return
        if response.status_code != 200:
            pool.mark_down(instance, f"GET /health answered {response.status_code}")
            return
        pool.mark_healthy(instance)
        await self._read_metrics(instance)

    async def _read_metrics(self, instance: Instance) -> None:
        # The router's own in-flight requests are in the instance's count too: subtract them
        # as of now, so that they are not counted twice until the next check.
        in_flight = instance.in_flight
        try:
            response = await self.client.get(instance.endpoint("/metrics"), timeout=self.timeout)
        except httpx.HTTPError as error:
            logger.debug("cannot read %s/metrics: %r", instance.url, error)
            return
        # No page: the instance keeps what the last one said, for adapters as for load.
        if response.status_code != 200:
            return
        page = parse_exposition(response.text, READ_METRICS)
        instance.external_load = max(0.0, reported_load(page) - in_flight)
        instance.kv_events_port = kv_events_port(page)
        track, weight = revision(page)
        if (track, weight) != (instance.track, instance.traffic_weight):
            logger.info(
                "%s instance %s is on track %s%s",
                instance.role,
                instance.url,
                track,
                "" if weight is None else f" (traffic weight {weight})",
            )
        instance.track, instance.traffic_weight = track, weight
        adapters = read_adapters(page)
        if adapters.served != instance.adapters.served:
            served = "unknown" if adapters.served is None else sorted(adapters.served)
            logger.info("%s instance %s serves adapters %s", instance.role, instance.url, served)
        instance.adapters = adapters
