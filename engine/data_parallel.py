"""Data parallelism in one pod: which engine core serves a request.

Pure bookkeeping, no I/O: `AsyncLLM` feeds it each core's SchedulerStats and asks it where a
request goes. A core's load is `4*waiting + running`, as vLLM's DP coordinator weighs it;
requests sent to a core since its last stats count as waiting there, so a burst of requests
arriving between two steps spreads out instead of piling onto one core.

Prefix affinity: for every core the router remembers (bounded, least recently used first out)
the block hashes of the prompts it sent there. A request whose leading full blocks a core
has served goes to that core, where they are probably still cached, unless that core is
overloaded: its load exceeds the least-loaded core's by more than `affinity_margin`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tidegate.engine.messages import SchedulerStats

# Weight of a waiting request against a running one: a waiting request still has its whole
# prompt to compute, a running one only its decodes.
WAITING_WEIGHT = 4
# Default slack of prefix affinity: two waiting requests' worth of extra load.
DEFAULT_AFFINITY_MARGIN = 2 * WAITING_WEIGHT


class _Core:
    """What the router knows about one engine core."""

    def __init__(self, max_hashes: int) -> None:
        self.waiting = 0
        self.running = 0
        self.sent_since_stats = 0
        self.max_hashes = max_hashes
        self.hashes: OrderedDict[bytes, None] = OrderedDict()

    @property
    def load(self) -> int:
        return WAITING_WEIGHT * (self.waiting + self.sent_since_stats) + self.running

    def matched_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt this core has served."""
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self.hashes:
                break
            matched += 1
        return matched

    def remember(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            self.hashes[block_hash] = None
            self.hashes.move_to_end(block_hash)
        while len(self.hashes) > self.max_hashes:
            self.hashes.popitem(last=False)


class DataParallelRouter:
    """Chooses an engine core per request: least loaded, or the one holding its prefix."""

    def __init__(
        self,
        num_cores: int,
        max_hashes_per_core: int,
        prefix_affinity: bool = True,
        affinity_margin: int = DEFAULT_AFFINITY_MARGIN,
    ) -> None:
        if num_cores < 1:
            raise ValueError(f"num_cores is {num_cores}; at least 1 engine core is needed")
        self.prefix_affinity = prefix_affinity
        self.affinity_margin = affinity_margin
        self._cores = [_Core(max_hashes_per_core) for _ in range(num_cores)]

    @property
    def num_cores(self) -> int:
        return len(self._cores)

    def loads(self) -> list[int]:
        """Each core's current load, `4*waiting + running`."""
        return [core.load for core in self._cores]

    def choose(self, block_hashes: Sequence[bytes] = ()) -> int:
        """The core for a request with these prompt block hashes; counts it as sent there."""
        loads = self.loads()
        least = min(range(len(loads)), key=loads.__getitem__)  # lowest index wins ties
        chosen = least
        if self.prefix_affinity and block_hashes:
            matches = [core.matched_blocks(block_hashes) for core in self._cores]
            best = max(range(len(matches)), key=lambda i: (matches[i], -loads[i]))
            if matches[best] > 0 and loads[best] <= loads[least] + self.affinity_margin:
                chosen = best
        core = self._cores[chosen]
        core.sent_since_stats += 1
        core.remember(block_hashes)
        return chosen

    def record_stats(self, core_index: int, stats: SchedulerStats) -> None:
        """A core's latest counts replace what the router assumed since its last report."""
        core = self._cores[core_index]
        core.waiting, core.running = stats.num_waiting, stats.num_running
        core.sent_since_stats = 0
