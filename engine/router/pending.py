"""Holding requests while a pool has no ready instance: the router's half of scale to zero.

A pool scaled to zero replicas, or whose pods all restart, has no healthy instance. A
request that comes then is not failed: it waits until an instance of the pool passes a
health check (`InstancePool.ready`, set by the health monitor, wakes every waiter at once)
and is then routed as usual. The wait is bounded twice, per pool: at most `max_pending`
requests are held at a time, each for at most `timeout_s`; beyond either the client gets a
503 with Retry-After. A client that leaves while held cancels its wait and leaves the queue.

`InstancePool.pending`, the number held right now, is the demand an autoscaler reads from
`tidegate:router_pending_requests{pool}` to scale a pool up from zero (router/metrics.py).
A request the router already sent to an instance that then failed is not held: it gets its
503 at once, as before, so that a fault is not hidden behind a wait. The exception is a 503
from a draining engine (DRAINING_HEADER, engine/http_server.py), which ran nothing of the
request: when it was the last healthy instance, the request waits for its replacement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tidegate.engine.router import errors
from tidegate.engine.router.instances import InstancePool

logger = logging.getLogger("tidegate.router")


class Holding:
    """The bounded wait of requests for pools with no healthy instance."""

    def __init__(self, max_pending: int, timeout_s: float, retry_after_s: float) -> None:
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        # Called when a pool's first request starts waiting: the health monitor checks at once.
        self.on_hold: Callable[[], None] = lambda: None

    def deadline(self) -> float:
        """The event-loop time until which a request that starts now may be held."""
        return asyncio.get_running_loop().time() + self.timeout_s

    def accepts(self, pool: InstancePool) -> bool:
        """Whether a request for `pool` would be routed or held now, rather than refused."""
        return pool.ready.is_set() or pool.pending < self.max_pending

    async def until_ready(self, pool: InstancePool, deadline: float) -> None:
        """Return once `pool` has a healthy instance; a 503 when full or past `deadline`."""
        if pool.ready.is_set():
            return
        if self.max_pending == 0:
            raise errors.no_instance(pool, self.retry_after_s)
        if pool.pending >= self.max_pending:
            raise errors.queue_full(pool, self.max_pending, self.retry_after_s)
        pool.pending += 1
        if pool.pending == 1:  # the first: later ones ride the rounds it started
            self.on_hold()
        try:
            async with asyncio.timeout_at(deadline):
                await pool.ready.wait()
        except TimeoutError:
            logger.warning("a request waited %g s for a %s instance", self.timeout_s, pool.role)
            raise errors.pending_timeout(pool, self.timeout_s, self.retry_after_s) from None
        finally:
            pool.pending -= 1
