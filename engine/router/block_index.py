"""Which instance holds which KV blocks, from the KV-cache events every instance publishes.

Each engine server started with `--kv-events-port` publishes its prefix cache's changes on a
ZMQ XPUB socket (engine/kv_events.py) and names the port in its /metrics
(`tidegate:kv_events_info{port}`), which the router's health checks read (several instances
on one host each have their own port). The router keeps one SUB socket per instance it
routes to, and for each instance the set of block hashes its engine cores hold. A request's
prompt, hashed exactly as the instance's KV cache manager hashes it (router/routing.py),
then matches a known number of leading blocks on every instance.

Getting in sync. A subscriber subscribes to the live topic and to a topic of its own; the
publisher answers that private subscription with a snapshot of everything held (a replay)
and the message number it stands at. Live messages that arrive before the snapshot wait;
those it already covers are dropped. A message or heartbeat from another epoch (the server
restarted) or a gap in the numbers (messages were dropped on a slow link) starts a new
replay, so an instance restart clears its old blocks from the index within a heartbeat of
its new server starting, and a lost message costs one replay, never a wrong index for good.

Two routers fed the same events hold the same index, so they make the same choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from tidegate.engine.kv_events import LIVE_TOPIC, REPLAY_TOPIC_PREFIX, CoreCache
from tidegate.engine.messages import (
    KVEventsMessage,
    KVEventsSnapshot,
)
from tidegate.engine.router.routing import Route

logger = logging.getLogger("tidegate.router")

# Live messages kept while a replay is on its way; past this, the replay is asked for again.
MAX_BUFFERED = 10_000
# A replay that does not come within this long is asked for again (the publisher may have
# started after our subscription was sent, or dropped the snapshot at its high-water mark).
REPLAY_TIMEOUT_S = 5.0


@dataclass
class HeldByInstance:
    """Everything one instance holds, per engine core."""

    pools: dict[int, CoreCache] = field(default_factory=dict)
    synced: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(len(pool.hashes) for pool in self.pools.values())

    def replace(self, snapshot: KVEventsSnapshot) -> None:
        self.pools = {index: CoreCache.from_held(held) for index, held in snapshot.pools.items()}
        self.synced = True

    def apply(self, message: KVEventsMessage) -> None:
        self.pools.setdefault(message.pool, CoreCache()).apply(message.events)

    def cached_tokens(self, route: Route) -> int:
        """Tokens of the route's prompt whose KV one of the instance's engine cores holds."""
        if route.token_ids is None or not self.pools:
            return 0
        # The adapter's digest, which its blocks' hashes include, as the events named it.
        digest = next(
            (pool.loras[route.model] for pool in self.pools.values() if route.model in pool.loras),
            None,
        )
        best = 0
        for pool in self.pools.values():
            matched = 0
            for block_hash in route.block_hashes(pool.block_size, digest):
                if block_hash not in pool.hashes:
                    break
                matched += 1
            best = max(best, matched * pool.block_size)
        # The engine always computes the prompt's last token itself.
        return min(best, max(route.num_tokens - 1, 0))


class BlockIndex:
    """The held blocks of every instance the router routes to, kept by one task each."""

    def __init__(
        self, default_port: int | None = None, context: zmq.asyncio.Context | None = None
    ) -> None:
        # The port of instances that do not say which they publish on.
        self.default_port = default_port
        self.context = context or zmq.asyncio.Context.instance()
        self.held: dict[str, HeldByInstance] = {}
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}

    def endpoint(self, url: str, port: int) -> str:
        """The ZMQ endpoint of the instance at this HTTP URL: its host, its events port."""
        host = urlsplit(url).hostname or "127.0.0.1"
        if ":" in host:  # an IPv6 literal
            host = f"[{host}]"
        return f"tcp://{host}:{port}"

    def track(self, ports: Mapping[str, int | None]) -> None:
        """Follow exactly these instances, by URL, on the events port each advertises.

        An instance with no port of its own uses the default; with neither it is not
        followed (it holds nothing, as far as routing knows). A changed port starts over.
        """
        wanted = {}
        for url, port in ports.items():
            port = port or self.default_port
            if port:
                wanted[url] = self.endpoint(url, port)
        for url, (endpoint, task) in list(self._tasks.items()):
            if wanted.get(url) != endpoint:
                task.cancel()
                del self._tasks[url]
                self.held.pop(url, None)
        for url, endpoint in wanted.items():
            if url not in self._tasks:
                self.held[url] = HeldByInstance()
                task = asyncio.create_task(self._follow(url, endpoint), name=f"kv-events {url}")
                self._tasks[url] = (endpoint, task)

    def cached_tokens(self, url: str, route: Route) -> int:
        held = self.held.get(url)
        return held.cached_tokens(route) if held is not None else 0

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, url: str, endpoint: str) -> None:
        """Keep self.held[url] equal to what the instance holds, until cancelled."""
        held = self.held[url]
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # never drop: a dropped message costs a replay
        socket.connect(endpoint)
        socket.subscribe(LIVE_TOPIC)
        follower = _Follower(held, socket, url)
        try:
            await follower.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("following the KV events of %s failed", url)
        finally:
            socket.close(linger=0)


class _Follower:
    """The replay-then-live state machine of one subscription."""

    def __init__(self, held: HeldByInstance, socket: zmq.asyncio.Socket, url: str) -> None:
        self.held = held
        self.socket = socket
        self.url = url
        self.live = msgspec.msgpack.Decoder(KVEventsMessage)
        self.snapshot = msgspec.msgpack.Decoder(KVEventsSnapshot)
        self.replay_topic: bytes | None = None
        self.buffered: list[KVEventsMessage] = []
        self.epoch: str | None = None
        self.seq = 0

    def ask_replay(self) -> None:
        if self.replay_topic is not None:
            self.socket.unsubscribe(self.replay_topic)
        self.replay_topic = REPLAY_TOPIC_PREFIX + uuid.uuid4().hex.encode()
        self.buffered.clear()
        self.socket.subscribe(self.replay_topic)

    async def run(self) -> None:
        self.ask_replay()
        while True:
            waiting = self.replay_topic is not None
            try:
                async with asyncio.timeout(REPLAY_TIMEOUT_S if waiting else None):
                    topic, payload = await self.socket.recv_multipart()
            except TimeoutError:
                self.ask_replay()
                continue
            if topic == LIVE_TOPIC:
                self.on_live(self.live.decode(payload))
            elif topic == self.replay_topic:
                self.on_snapshot(self.snapshot.decode(payload))

    def on_snapshot(self, snapshot: KVEventsSnapshot) -> None:
        if self.held.synced and snapshot.epoch != self.epoch:
            logger.info("%s restarted: its KV-cache index starts again from its replay", self.url)
        self.socket.unsubscribe(self.replay_topic)  # type: ignore[arg-type]
        self.replay_topic = None
        self.held.replace(snapshot)
        self.epoch, self.seq = snapshot.epoch, snapshot.seq
        buffered, self.buffered = self.buffered, []
        for message in buffered:
            if message.epoch == self.epoch and message.seq <= self.seq:
                continue  # the snapshot covers it
            self.on_live(message)
            if self.replay_topic is not None:
                return

    def on_live(self, message: KVEventsMessage) -> None:
        if not message.events:  # a heartbeat: where the publisher stands
            if self.replay_topic is None and (
                message.epoch != self.epoch or message.seq != self.seq
            ):
                logger.info(
                    "%s KV events stand at %s#%d, the index at %s#%d; asking for a replay",
                    self.url,
                    message.epoch,
                    message.seq,
                    self.epoch,
                    self.seq,
                )
                self.ask_replay()
            return
        if self.replay_topic is not None:
            self.buffered.append(message)
            if len(self.buffered) > MAX_BUFFERED:
                self.ask_replay()
            return
        if message.epoch != self.epoch or message.seq != self.seq + 1:
            # A restart, or messages lost: what we hold may be wrong; start again.
            logger.info(
                "%s KV events jumped from %s#%d to %s#%d; asking for a replay",
                self.url,
                self.epoch,
                self.seq,
                message.epoch,
                message.seq,
            )
            self.ask_replay()
            self.buffered.append(message)
            return
        self.held.apply(message)
        self.seq = message.seq
