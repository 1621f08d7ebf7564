"""The scheduler's side of KV transfers: pinned blocks (producer), parked requests and pulls
(consumer), and what it owes the workers and the producers.

No I/O: the scheduler hands it requests and worker reports; sockets stay in the
connector. The scheduler keeps its queues; this coordinator keeps everything else, and
only its methods touch it.
"""

from __future__ import annotations

import itertools
import logging
import time

from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request, RequestStatus
from tidegate.engine.kv_transfer.base import KVConnectorScheduler
from tidegate.engine.kv_transfer.params import RemoteDecode, RemotePrefill, prompt_digest
from tidegate.engine.kv_transfer.tracker import Pin, PinTable, PullTracker
from tidegate.engine.messages import KVConnectorMetadata, KVRecvDone, KVRecvSpec

logger = logging.getLogger(__name__)

# A consumer gives up on a pull this long after its workers should have (lost reports).
_PULL_GRACE_S = 5.0


class KVTransferCoordinator:
    """Pins a producer's finished prompts, parks a consumer's requests while their KV is
    pulled, and collects what the workers (`pin`/`unpin`, connector metadata) and the
    producers (releases) must hear. The engine core takes those after every step and every
    event, so a worker stops serving blocks before they are reused.
    """

    def __init__(
        self,
        connector: KVConnectorScheduler | None,
        kv_cache_manager: KVCacheManager,
        timeout_s: float,
        world_size: int,
    ) -> None:
        self._connector = connector
        self._kv_cache_manager = kv_cache_manager
        self._timeout_s = timeout_s
        self._pins = PinTable()
        # Producer request id -> transfer id of its pin, for aborts.
        self._pin_of_request: dict[str, str] = {}
        self._sequence = itertools.count()
        self._pulls = PullTracker(world_size)
        # Consumer requests whose blocks are allocated and whose KV is on its way.
        self._parked: dict[str, Request] = {}
        # Pulled and not yet run: the step that first runs them writes their KV (`load`).
        self._to_load: set[str] = set()
        # Owed to the workers and the producers until the engine core takes them.
        self._meta = KVConnectorMetadata()
        self._pin: dict[str, list[int]] = {}
        self._unpin: list[str] = []
        self._releases: list[RemotePrefill] = []
        self._latencies: list[float] = []
        self._pins_expired = 0
        self._received_bytes = 0
        self._fallbacks = 0

    # -- producer: pins -----------------------------------------------------------------------

    def wants_pin(self, request: Request) -> bool:
        """True for a producer request: its finished prompt's blocks wait for a consumer."""
        return self._connector is not None and isinstance(request.kv_transfer, RemoteDecode)

    def pin(self, request: Request) -> None:
        """Keep a finished prompt's blocks for a consumer and say where they are."""
        assert self._connector is not None
        transfer_id = f"{request.request_id}~{next(self._sequence)}"
        block_ids = self._kv_cache_manager.detach(request, transfer_id)
        deadline = time.monotonic() + self._timeout_s
        self._pins.add(Pin(transfer_id, request.request_id, len(block_ids), deadline))
        self._pin[transfer_id] = block_ids
        self._pin_of_request[request.request_id] = transfer_id
        params = self._connector.transfer_params(
            transfer_id, block_ids, prompt_digest(request.prompt_token_ids)
        )
        if request.lora_request is not None:
            # The adapter travels with the blocks: KV computed under it is only valid for a
            # consumer request under the same weights.
            params["lora_name"] = request.lora_request.name
            params["lora_digest"] = request.lora_request.digest
        request.kv_transfer_params_out = params

    def unpin(self, transfer_id: str) -> None:
        """A consumer read a pin's blocks: free them (a repeated notice is a no-op)."""
        self._free_pin(transfer_id)

    def unpin_request(self, req_id: str) -> None:
        """An abort of a finished producer request frees its pin, if it still has one."""
        transfer_id = self._pin_of_request.get(req_id)
        if transfer_id is not None:
            self._free_pin(transfer_id)

    def _free_pin(self, transfer_id: str) -> bool:
        """Free a pin's blocks and tell the workers; False if it was released already."""
        pin = self._pins.pop(transfer_id)
        if pin is None:
            return False  # a second notice, or one after the timeout
        self._kv_cache_manager.free_detached(transfer_id)
        self._unpin.append(transfer_id)
        if self._pin_of_request.get(pin.request_id) == transfer_id:
            del self._pin_of_request[pin.request_id]
        return True

    # -- consumer: pulls ----------------------------------------------------------------------

    def wants_pull(self, request: Request) -> bool:
        """True for a consumer request whose prompt's KV has not been asked for yet."""
        return (
            self._connector is not None
            and isinstance(request.kv_transfer, RemotePrefill)
            and not request.kv_pull_tried
        )

    def pull_problem(self, request: Request, num_tokens: int) -> str:
        """Why the producer's blocks cannot stand for the prompt's first `num_tokens` ('' when
        they can)."""
        params = request.kv_transfer
        assert isinstance(params, RemotePrefill)
        block_size = self._kv_cache_manager.block_size
        num_blocks = -(-num_tokens // block_size)
        if params.remote_block_size != block_size:
            return f"producer blocks hold {params.remote_block_size} tokens, ours {block_size}"
        if params.prompt_digest != prompt_digest(request.prompt_token_ids):
            return "the producer tokenized a different prompt (tokenizer or template differ)"
        ours = request.lora_request
        if params.lora_digest != (ours.digest if ours is not None else None):
            theirs = f"adapter {params.lora_name!r}" if params.lora_digest else "the base model"
            mine = f"adapter {ours.name!r}" if ours is not None else "the base model"
            return (
                f"the producer computed the prompt under {theirs}, this request runs under {mine}"
            )
        if len(params.remote_block_ids) < num_blocks:
            return f"producer named {len(params.remote_block_ids)} blocks; the prompt needs {num_blocks}"
        return ""

    def skip_pull(self, request: Request, problem: str = "") -> None:
        """Compute the prompt here instead (a problem is logged and counted as a fallback);
        the producer may free its pin."""
        assert isinstance(request.kv_transfer, RemotePrefill)
        request.kv_pull_tried = True
        if problem:
            logger.warning("computing %s locally: %s", request.request_id, problem)
            self._fallbacks += 1
        self._releases.append(request.kv_transfer)

    def park(self, request: Request, num_cached: int, num_remote: int) -> None:
        """Start pulling the `num_remote` prompt tokens after the `num_cached` the prefix cache
        holds into the request's allocated blocks; it waits (WAITING_FOR_REMOTE_KVS) meanwhile."""
        params = request.kv_transfer
        assert isinstance(params, RemotePrefill)
        block_size = self._kv_cache_manager.block_size
        first, end = num_cached // block_size, -(-(num_cached + num_remote) // block_size)
        rid = request.request_id
        request.kv_pull_tried = True
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._parked[rid] = request
        self._pulls.start(rid, time.monotonic() + self._timeout_s + _PULL_GRACE_S)
        self._meta.recv.append(
            KVRecvSpec(
                req_id=rid,
                transfer_id=params.remote_request_id,
                host=params.remote_host,
                data_ports=params.remote_data_ports,
                remote_block_ids=params.remote_block_ids[first:end],
                local_block_ids=self._kv_cache_manager.get_block_ids(rid)[first:end],
            )
        )

    def record_pull(self, event: KVRecvDone) -> Request | None:
        """Fold in one rank's report; the request to queue again once its pull is over (its KV
        is here, or it failed and the prompt is computed locally), else None."""
        state = self._pulls.report(
            event.req_id, event.rank, event.ok, event.num_bytes, event.seconds
        )
        if state == "done":
            return self._pull_done(event.req_id)
        if state == "failed":
            return self._pull_failed(event.req_id, event.error)
        return None

    def schedule_load(self, req_id: str) -> None:
        """The request runs for the first time: if its KV was pulled, this step writes it."""
        if req_id in self._to_load:
            self._to_load.discard(req_id)
            self._meta.load.append(req_id)

    def forget_pull(self, request: Request) -> None:
        """A request finished: workers drop what they pull or pulled for it and did not load."""
        rid = request.request_id
        if self._parked.pop(rid, None) is not None:
            self._pulls.cancel(rid)
            self._drop_pull(request)
        elif rid in self._to_load:
            self._to_load.discard(rid)
            self._meta.discard.append(rid)

    def _pull_done(self, rid: str) -> Request:
        request = self._parked.pop(rid)
        num_bytes, seconds = self._pulls.finish(rid)
        self._received_bytes += num_bytes
        self._latencies.append(seconds)
        request.num_computed_tokens = request.num_prompt_tokens - 1
        # Only now is the KV really there: from here on other requests may hit these blocks.
        self._kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self._to_load.add(rid)
        assert isinstance(request.kv_transfer, RemotePrefill)
        self._releases.append(request.kv_transfer)
        return request

    def _pull_failed(self, rid: str, reason: str) -> Request | None:
        request = self._parked.pop(rid, None)
        if request is None:
            return None
        self._pulls.cancel(rid)
        logger.warning("KV pull of %s failed (%s); computing the prompt locally", rid, reason)
        self._fallbacks += 1
        # It keeps its blocks and its local prefix hits; the rest is computed as usual.
        request.status = RequestStatus.WAITING
        self._drop_pull(request)
        return request

    def _drop_pull(self, request: Request) -> None:
        """Workers drop what they pulled for the request; the producer may free its pin."""
        self._meta.discard.append(request.request_id)
        assert isinstance(request.kv_transfer, RemotePrefill)
        self._releases.append(request.kv_transfer)

    # -- time ---------------------------------------------------------------------------------

    def expire(self, now: float) -> list[Request]:
        """Free pins nobody claimed in time; the requests whose pull never finished, to queue
        again and compute locally."""
        for transfer_id in self._pins.expired(now):
            if self._free_pin(transfer_id):
                self._pins_expired += 1
                logger.warning("KV transfer %s expired; its blocks are freed", transfer_id)
        requeue = []
        for rid in self._pulls.pop_expired(now):
            request = self._pull_failed(rid, "no report from the workers in time")
            if request is not None:
                requeue.append(request)
        return requeue

    def next_deadline(self) -> float | None:
        """When the next pin or pull times out; None when nothing can."""
        deadlines = [d for d in (self._pins.next_deadline(), self._pulls.next_deadline()) if d]
        return min(deadlines, default=None)

    # -- what others must hear ----------------------------------------------------------------

    def take_connector_metadata(self) -> KVConnectorMetadata | None:
        """The workers' part of the next step, if it has any."""
        meta = self._meta
        if not (meta.recv or meta.load or meta.discard):
            return None
        self._meta = KVConnectorMetadata()
        return meta

    def take_pin_updates(self) -> tuple[dict[str, list[int]], list[str]]:
        """Transfers the workers start serving (with their blocks) and stop serving."""
        pin, unpin = self._pin, self._unpin
        self._pin, self._unpin = {}, []
        return pin, unpin

    def take_releases(self) -> list[RemotePrefill]:
        """Producers' pins this consumer is done with (read, or given up on)."""
        releases, self._releases = self._releases, []
        return releases

    def take_latencies(self) -> list[float]:
        """Seconds each pull took, since the last take."""
        latencies, self._latencies = self._latencies, []
        return latencies

    # -- counts -------------------------------------------------------------------------------

    def has_pending(self) -> bool:
        """True while pulls are in flight or blocks are pinned for consumers."""
        return bool(self._parked or self._pins)

    @property
    def num_parked(self) -> int:
        """Consumer requests waiting for their KV."""
        return len(self._parked)

    @property
    def num_pinned_blocks(self) -> int:
        return self._pins.num_blocks

    @property
    def num_pins_expired(self) -> int:
        return self._pins_expired

    @property
    def num_received_bytes(self) -> int:
        return self._received_bytes

    @property
    def num_fallbacks(self) -> int:
        """Pulls given up (unusable params, failures, timeouts); their prompts ran locally."""
        return self._fallbacks
