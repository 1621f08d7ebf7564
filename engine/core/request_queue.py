"""The WAITING queue, in the order a scheduling policy admits from it.

- fcfs: arrival order (vLLM's default).
- priority: lowest `priority` first, ties by arrival (vLLM's semantics).
- fair: deficit round robin over tenants, each tenant's requests in arrival order. While a
  tenant has requests waiting, every token its requests compute (prompt chunks and decodes,
  charged by the scheduler) comes off its deficit; the tenant whose turn it is admits while
  its deficit is positive, and when no tenant that could admit has credit left, each of them
  gets the same quanta. Tenants with work waiting thus share step tokens equally, whatever
  their arrival rates, and a tenant's flood delays the others by no more than its share.

A request put back (preempted, or its KV pulled) goes before the rest of its order: first in
line under fcfs and in its tenant's line under fair; under priority it keeps its (priority,
arrival) place. Each queue counts its requests per tenant, for the per-tenant limits.

A scheduling pass walks a queue with `peek` and `pop`. `set_aside` makes the request at the
head wait for this pass, `exclude` does so for every request of a tenant, and `end_pass` puts
them all back where they were.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from tidegate.engine.config import SchedulingPolicy
from tidegate.engine.core.request import Request

# None is the anonymous tenant.
Tenant = str | None

# Tokens a tenant's deficit grows by per round under fair: small beside a step's budget, so
# that tenants take turns several times within one step.
FAIR_QUANTUM_TOKENS = 256


class WaitingQueue:
    """What every policy shares: membership, per-tenant counts, and one pass's set-aside."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._counts: dict[Tenant, int] = {}
        # Taken off the head for this pass only, in the order they were taken.
        self._aside: list[Request] = []
        self._excluded: set[Tenant] = set()

    def __len__(self) -> int:
        return len(self._ids)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._ids

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in admission order (those set aside this pass first)."""
        yield from self._aside
        yield from self._ordered()

    def num_of(self, tenant: Tenant) -> int:
        """Requests of this tenant waiting."""
        return self._counts.get(tenant, 0)

    @property
    def tenants(self) -> dict[Tenant, int]:
        """Tenant -> its waiting requests, for those with any."""
        return dict(self._counts)

    def add(self, request: Request) -> None:
        """A new arrival."""
        self._enter(request)
        self._push(request, front=False)

    def prepend(self, request: Request) -> None:
        """A request put back: preempted, or its prompt's KV pulled."""
        self._enter(request)
        self._push(request, front=True)

    def remove(self, request: Request) -> bool:
        """Take a request out wherever it is (finished); False when it is not waiting."""
        if request.request_id not in self._ids:
            return False
        if request in self._aside:
            self._aside.remove(request)
        else:
            self._discard(request)
        self._leave(request)
        return True

    def peek(self) -> Request | None:
        """The next request this pass may admit; None when none is left."""
        return self._head()

    def pop(self, request: Request) -> None:
        """Take `request`, which `peek` returned (admitted, or parked for its KV)."""
        assert self._head() is request, "only the request at the head is taken"
        self._take(request)
        self._leave(request)

    def set_aside(self) -> None:
        """The request `peek` returned waits for this pass; the next one comes up."""
        request = self._head()
        assert request is not None, "nothing to set aside"
        self._take(request)
        self._aside.append(request)

    def exclude(self, tenant: Tenant) -> None:
        """No request of this tenant comes up for the rest of the pass."""
        self._excluded.add(tenant)

    def end_pass(self) -> None:
        """Put back what the pass set aside, each where it was."""
        for request in reversed(self._aside):
            self._push(request, front=True)
        self._aside.clear()
        self._excluded.clear()

    def charge(self, tenant: Tenant, num_tokens: int) -> None:
        """Tokens a tenant's requests computed this step (only the fair policy counts them)."""

    # -- what each policy implements -------------------------------------------------------

    def _push(self, request: Request, front: bool) -> None:
        raise NotImplementedError

    def _head(self) -> Request | None:
        """The head of this pass, past excluded tenants (which it may set aside)."""
        raise NotImplementedError

    def _take(self, request: Request) -> None:
        """Remove `request`, which `_head` just returned."""
        raise NotImplementedError

    def _discard(self, request: Request) -> None:
        """Remove `request` from wherever it is in the order."""
        raise NotImplementedError

    def _ordered(self) -> Iterator[Request]:
        raise NotImplementedError

    def _tenant_gone(self, tenant: Tenant) -> None:
        """The tenant's last waiting request left."""

    # -- bookkeeping --------------------------------------------------------------------------

    def _enter(self, request: Request) -> None:
        self._ids.add(request.request_id)
        self._counts[request.tenant] = self._counts.get(request.tenant, 0) + 1

    def _leave(self, request: Request) -> None:
        self._ids.discard(request.request_id)
        left = self._counts[request.tenant] - 1
        if left:
            self._counts[request.tenant] = left
        else:
            del self._counts[request.tenant]
            self._tenant_gone(request.tenant)


class FCFSQueue(WaitingQueue):
    """One line, in arrival order; put-back requests at its front."""

    def __init__(self) -> None:
        super().__init__()
        self._line: deque[Request] = deque()

    def _push(self, request: Request, front: bool) -> None:
        if front:
            self._line.appendleft(request)
        else:
            self._line.append(request)

    def _head(self) -> Request | None:
        line = self._line
        while line and line[0].tenant in self._excluded:
            self._aside.append(line.popleft())
        return line[0] if line else None

    def _take(self, request: Request) -> None:
        self._line.popleft()

    def _discard(self, request: Request) -> None:
        self._line.remove(request)

    def _ordered(self) -> Iterator[Request]:
        return iter(self._line)


class PriorityQueue(WaitingQueue):
    """A heap by (priority, arrival time); a put-back request keeps its place."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # ties past arrival time: the order they were pushed

    def _push(self, request: Request, front: bool) -> None:
        entry = (request.priority, request.arrival_time, next(self._seq), request)
        heapq.heappush(self._heap, entry)

    def _head(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][3].tenant in self._excluded:
            self._aside.append(heapq.heappop(heap)[3])
        return heap[0][3] if heap else None

    def _take(self, request: Request) -> None:
        heapq.heappop(self._heap)

    def _discard(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def _ordered(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


class FairQueue(WaitingQueue):
    """Deficit round robin over tenants; each tenant's line in arrival order.

    A deficit may go below zero (a prompt chunk costs more than the credit left): the debt is
    paid from later quanta, so a tenant never gets more than its share by sending large
    requests. A tenant whose last waiting request leaves forgets its deficit, as in DRR.
    """

    def __init__(self, quantum: int = FAIR_QUANTUM_TOKENS) -> None:
        super().__init__()
        self.quantum = quantum
        self._lines: dict[Tenant, deque[Request]] = {}
        self._deficit: dict[Tenant, int] = {}
        # Tenants with requests waiting, in turn order: [0] has the turn.
        self._ring: deque[Tenant] = deque()

    @property
    def deficits(self) -> dict[Tenant, int]:
        """Tenant -> its deficit in tokens, for tenants with requests waiting."""
        return dict(self._deficit)

    def charge(self, tenant: Tenant, num_tokens: int) -> None:
        if tenant not in self._deficit:
            return  # nothing waiting: its running requests are not in the competition
        self._deficit[tenant] -= num_tokens
        if self._deficit[tenant] <= 0 and self._ring[0] == tenant:
            self._ring.rotate(-1)  # its turn is over: the next tenant's comes first

    def _push(self, request: Request, front: bool) -> None:
        tenant = request.tenant
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = deque()
            self._deficit[tenant] = 0
            self._ring.append(tenant)  # a newcomer takes its turn after the others
        if front:
            line.appendleft(request)
        else:
            line.append(request)

    def _eligible(self, tenant: Tenant) -> bool:
        return tenant not in self._excluded and bool(self._lines[tenant])

    def _head(self) -> Request | None:
        for _ in range(2):
            for i, tenant in enumerate(self._ring):
                if self._eligible(tenant) and self._deficit[tenant] > 0:
                    self._ring.rotate(-i)
                    return self._lines[tenant][0]
            eligible = [t for t in self._ring if self._eligible(t)]
            if not eligible:
                return None
            # No one who could admit has credit: as many rounds of quanta as bring the least
            # indebted above zero, to every one of them alike.
            rounds = min(-self._deficit[t] // self.quantum + 1 for t in eligible)
            for tenant in eligible:
                self._deficit[tenant] += rounds * self.quantum
        raise AssertionError("a round of quanta gave no tenant credit")

    def _take(self, request: Request) -> None:
        self._lines[request.tenant].popleft()

    def _discard(self, request: Request) -> None:
        self._lines[request.tenant].remove(request)

    def _ordered(self) -> Iterator[Request]:
        for tenant in self._ring:
            yield from self._lines[tenant]

    def _tenant_gone(self, tenant: Tenant) -> None:
        del self._lines[tenant], self._deficit[tenant]
        self._ring.remove(tenant)


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue:
    """The WAITING queue of a scheduling policy."""
    if policy == "priority":
        return PriorityQueue()
    if policy == "fair":
        return FairQueue()
    return FCFSQueue()
