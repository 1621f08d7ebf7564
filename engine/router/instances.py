"""The prefill or decode instances the router knows, their health and their load."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from tidegate.engine.config import DEFAULT_CANARY_WEIGHT
from tidegate.engine.router.adapters import UNKNOWN, Adapters
from tidegate.engine.router.block_index import BlockIndex
from tidegate.engine.router.routing import Route
from tidegate.engine.router.selection import Selector

logger = logging.getLogger("tidegate.router")

# Rollout tracks (EngineArgs.track): a canary takes its weight's share of a pool's requests.
STABLE = "stable"
CANARY = "canary"
TRACKS = (STABLE, CANARY)


@dataclass(eq=False)
class Instance:
    """One engine server: its base URL, whether it answers, how busy it is, its adapters."""

    role: str
    url: str
    healthy: bool = False
    # Requests this router has sent and not yet seen finish.
    in_flight: int = 0
    # Requests the instance reported (running + waiting) that are not this router's: other
    # router replicas' and anyone calling it directly; refreshed at every health check.
    external_load: float = 0.0
    # The LoRA adapters it serves and those hot on it, as of its last /metrics read.
    adapters: Adapters = UNKNOWN
    # The port it publishes KV-cache events on, as its /metrics says (None: it does not).
    kv_events_port: int | None = None
    # Its rollout track, as its /metrics says (tidegate:revision_info; stable when it says
    # nothing), and for a canary the share of the pool's requests it asks for.
    track: str = STABLE
    traffic_weight: float | None = None
    last_error: str | None = None

    @property
    def canary(self) -> bool:
        """Whether it runs the canary revision of its role (a share of the requests)."""
        return self.track == CANARY

    @property
    def load(self) -> float:
        """What selection compares: our own in-flight requests plus everyone else's."""
        return self.in_flight + self.external_load

    def endpoint(self, path: str) -> str:
        """The absolute URL of `path` on this instance."""
        return self.url.rstrip("/") + path


class InstancePool:
    """All instances of one role; membership follows discovery, health follows checks.

    Canaries (an instance whose /metrics says `track="canary"`) take a share of the pool's
    requests: when a request's candidates include canaries and stable instances, a draw
    from `rng` sends it to the canaries with probability the canary share (the largest
    weight among them), else to the stable ones; the selector ranks within that group, and
    the other group follows as fallbacks. Only canaries, or none: no draw, the selector
    ranks them all.
    """

    def __init__(
        self,
        role: str,
        selector: Selector | None = None,
        index: BlockIndex | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.role = role
        self.selector = selector or Selector()
        # Draws which track a request goes to (canaries beside stable instances); a test
        # seeds its own.
        self.rng = rng or random.Random()
        # The blocks each instance holds, when the router follows their KV events.
        self.index = index
        self._instances: dict[str, Instance] = {}
        # Set while an instance is healthy: held requests wait on it (router/pending.py).
        self.ready = asyncio.Event()
        # Requests held right now because no instance was healthy when they came.
        self.pending = 0
        # Routed by held blocks (first choices only): their prompt tokens, and those the chosen
        # instance held. The ratio is the prefix-cache hit routing expects.
        self.routed_prompt_tokens = 0
        self.routed_cached_tokens = 0
        # Requests routed (first choices) by the track of the instance chosen.
        self.routed_requests = dict.fromkeys(TRACKS, 0)

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._instances.values()))

    def __len__(self) -> int:
        return len(self._instances)

    def set_urls(self, urls: Iterable[str]) -> None:
        """Make the pool hold exactly these instances, keeping the state of those it had."""
        wanted = list(dict.fromkeys(urls))
        for url in list(self._instances):
            if url not in wanted:
                logger.info("%s instance %s is gone from discovery", self.role, url)
                del self._instances[url]
        for url in wanted:
            if url not in self._instances:
                logger.info("%s instance %s discovered", self.role, url)
                # Unhealthy until its first check passes: a pod that is still loading its
                # weights must not receive requests.
                self._instances[url] = Instance(self.role, url)
        self._update_ready()

    def healthy(self) -> list[Instance]:
        """The instances that passed their last check and have not failed since."""
        return [i for i in self._instances.values() if i.healthy]

    def pick(self, route: Route, exclude: Collection[str] = ()) -> Instance | None:
        """The healthy instance to send a request on this route to, if any."""
        ranked = self.rank(route, exclude, limit=1)
        return ranked[0] if ranked else None

    def rank(
        self,
        route: Route,
        exclude: Collection[str] = (),
        only: Collection[str] | None = None,
        limit: int | None = None,
    ) -> list[Instance]:
        """Healthy instances for a request on this route, best first (Selector.order).

        `only` limits the candidates to these URLs (a gateway's subset hint). When the
        route's `model` names an adapter that some candidate serves, only those that serve
        it are candidates, and among those within the load bound the ones where it is hot
        come first. An adapter no candidate is known to serve (or the base model) may go to
        any: the engine that gets it loads it or answers 404 itself.

        With canaries and stable instances among the candidates, a draw picks the group
        that comes first (the canaries with probability `canary_share`); each group is
        ranked on its own, the other following as fallbacks. Every call draws anew: a retry
        (`exclude`) goes to the canaries in the same proportion, if any is left.
        """
        candidates = [
            i for i in self.healthy() if i.url not in exclude and (only is None or i.url in only)
        ]
        hot: set[str] = set()
        if route.model is not None:
            serving = [i for i in candidates if i.adapters.serves(route.model)]
            if serving:
                candidates = serving
                hot = {i.url for i in serving if i.adapters.is_hot(route.model)}
        cached = None
        if self.index is not None and route.token_ids is not None:
            cached = {i.url: self.index.cached_tokens(i.url, route) for i in candidates}
        order: list[str] = []
        for group in self._groups(candidates):
            loads = {i.url: i.load for i in group}
            order += self.selector.order(route.key, loads, preferred=hot, cached=cached)
        if order and not exclude:
            self.routed_requests[CANARY if self._instances[order[0]].canary else STABLE] += 1
            if cached is not None:
                self.routed_prompt_tokens += route.num_tokens
                self.routed_cached_tokens += cached[order[0]]
        return [self._instances[url] for url in order[:limit]]

    def _groups(self, candidates: list[Instance]) -> list[list[Instance]]:
        """The candidates in the groups to rank one after the other: the drawn track first.

        No draw (and one group) unless canaries and stable instances are both there.
        """
        canaries = [i for i in candidates if i.canary]
        if not canaries or len(canaries) == len(candidates):
            return [candidates]
        stable = [i for i in candidates if not i.canary]
        if self.rng.random() < canary_share(canaries):
            return [canaries, stable]
        return [stable, canaries]

    def mark_healthy(self, instance: Instance) -> None:
        """Take an instance (back) into rotation."""
        if not instance.healthy:
            logger.info("%s instance %s is healthy", self.role, instance.url)
        instance.healthy = True
        instance.last_error = None
        self._update_ready()

    def mark_down(self, instance: Instance, reason: str) -> None:
        """Take an instance out of rotation until a health check passes again."""
        if instance.healthy or instance.last_error is None:  # up before, or never checked
            logger.warning("%s instance %s is down: %s", self.role, instance.url, reason)
        instance.healthy = False
        instance.last_error = reason
        # It may come back as a new process, with other adapters: unknown until it says.
        instance.adapters = UNKNOWN
        self._update_ready()

    def _update_ready(self) -> None:
        if self.healthy():
            self.ready.set()  # wakes every held request at once
        else:
            self.ready.clear()


def canary_share(canaries: Iterable[Instance]) -> float:
    """The share of a pool's requests its canaries take together: the largest weight among
    them (an instance's weight is in (0, 1); one read without a weight takes the engine's
    default, router/health.py)."""
    return max((i.traffic_weight or DEFAULT_CANARY_WEIGHT for i in canaries), default=0.0)
