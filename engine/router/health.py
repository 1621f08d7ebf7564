"""The background loop that re-resolves every URL, checks every instance and reads its load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import httpx

from tidegate.engine.router.discovery import discover
from tidegate.engine.router.instances import Instance, InstancePool

logger = logging.getLogger("tidegate.router")

# Engine gauges whose sum is the work an instance has queued (every series: one per core).
LOAD_METRICS = ("tidegate:num_requests_running", "tidegate:num_requests_waiting")
# While requests are held for a pool with no healthy instance, rounds come this often (or
# more often, with a shorter --health-interval): a held request is routed within this
# much of its instance turning ready.
HOLDING_INTERVAL_S = 0.25


def reported_load(exposition: str) -> float:
    """Running plus waiting requests in an engine's /metrics text, summed over series."""
    total = 0.0
    for line in exposition.splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name.strip() in LOAD_METRICS:
            try:
                total += float(rest.rsplit(maxsplit=1)[-1])
            except (ValueError, IndexError):
                continue
    return total


class HealthMonitor:
    """Every `interval` seconds: discovery, then GET /health (and /metrics) on each instance.

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
    ) -> None:
        self.pools = pools
        self.seeds = seeds
        self.client = client
        self.interval = interval
        # A check slower than a round would delay the next round for every instance; a
        # /health that takes seconds to answer is a sick instance anyway.
        read_s = max(connect_timeout, min(interval, 10.0))
        self.timeout = httpx.Timeout(read_s, connect=connect_timeout)
        self._expanded: dict[str, dict[str, list[str]]] = {role: {} for role in pools}
        self._woken = asyncio.Event()

    def wake(self) -> None:
        """Start the next round now (a request has started waiting for an instance)."""
        self._woken.set()

    async def run_round(self) -> None:
        """One round: update every pool's membership, then check all instances at once."""
        for role, pool in self.pools.items():
            self._expanded[role] = await discover(self.seeds[role], self._expanded[role])
            pool.set_urls(url for urls in self._expanded[role].values() for url in urls)
        checks = [self._check(pool, instance) for pool in self.pools.values() for instance in pool]
        await asyncio.gather(*checks)

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
        await self._read_load(instance)

    async def _read_load(self, instance: Instance) -> None:
        # The router's own in-flight requests are in the instance's count too: subtract them
        # as of now, so that they are not counted twice until the next check.
        in_flight = instance.in_flight
        try:
            response = await self.client.get(instance.endpoint("/metrics"), timeout=self.timeout)
        except httpx.HTTPError as error:
            logger.debug("cannot read %s/metrics: %r", instance.url, error)
            return
        if response.status_code == 200:
            instance.external_load = max(0.0, reported_load(response.text) - in_flight)
