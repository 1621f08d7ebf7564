"""The EngineCore process: socket threads feed a busy loop that steps the engine.

The loop owns the scheduler; two I/O threads own the sockets (ZMQ sockets are not
thread-safe) and spend their time in msgspec and ZMQ, which release the GIL. When no
request is unfinished the loop blocks on its input queue, so an idle engine uses no CPU.
At one tensor-parallel rank the loop also runs the model (the worker is in this process);
an exception out of a step ends the loop as a dead worker process does: engine_dead, exit 1.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Any

import msgspec
import zmq

from tidegate.engine.allocator import allocator_in_use
from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from tidegate.engine.process import become_child_process

logger = logging.getLogger(__name__)

# First frame of the engine core's handshake on the request socket.
READY = b"READY"
FAILED = b"FAILED"

# Put on the input queue by the worker watch: a worker died while the loop was idle.
_WORKER_DIED = object()
# Put on the output queue: send nothing more, the process is ending.
_STOP_SENDING = object()
# Put on the input queue by the KV connector's thread: events are waiting to be applied.
_KV_EVENT = object()
# Put on the input queue by a grammar compile thread: a waiting request may start.
_GRAMMAR_READY = object()


def run_engine_core(
    args: EngineArgs,
    engine_index: int,
    input_address: str,
    output_address: str,
    max_waiting_requests: int | None,
    max_waiting_per_tenant: int | None = None,
) -> None:
    """Process entry point: build the engine, shake hands, loop until shutdown or death."""
    title = f"tidegate::engine_core_{engine_index}"
    become_child_process(title)
    ctx = zmq.Context(io_threads=1)
    requests = ctx.socket(zmq.DEALER)
    requests.setsockopt(zmq.IDENTITY, engine_index.to_bytes(2, "little"))
    requests.setsockopt(zmq.LINGER, 5000)
    requests.connect(input_address)
    try:
        from tidegate.engine.device import use_own_devices

        if args.data_parallel_size_local > 1:
            use_own_devices(args, engine_index)
        # At one rank the worker runs in this process (uni), else in worker processes (mp).
        engine = EngineCore(args, engine_index=engine_index)
        logger.info("engine core %d runs on malloc: %s", engine_index, allocator_in_use())
    except Exception as error:
        detail = str(error) if isinstance(error, ValueError) else traceback.format_exc()
        logger.error("engine core %d failed to start: %s", engine_index, detail)
        requests.send_multipart([FAILED, detail.encode()])
        requests.close()
        ctx.term()
        raise SystemExit(1) from None
    ready = EngineCoreReady(
        engine_index=engine_index,
        max_model_len=engine.max_model_len,
        num_kv_blocks=engine.kv_cache_manager.num_total_blocks,
        block_size=args.block_size,
        dtype=engine.args.dtype,
    )
    requests.send_multipart([READY, msgspec.msgpack.encode(ready)])
    proc = EngineCoreProc(engine, engine_index, max_waiting_requests, max_waiting_per_tenant)
    code = proc.run(ctx, requests, output_address)
    ctx.term()
    raise SystemExit(code)


class EngineCoreProc:
    """The busy loop and its two socket threads."""

    def __init__(
        self,
        engine: EngineCore,
        engine_index: int,
        max_waiting_requests: int | None,
        max_waiting_per_tenant: int | None = None,
    ) -> None:
        self.engine = engine
        self.engine_index = engine_index
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._shutting_down = threading.Event()
        engine.kv_wakeup = lambda: self.input_queue.put(_KV_EVENT)
        engine.grammar.wakeup = lambda: self.input_queue.put(_GRAMMAR_READY)

    def run(self, ctx: zmq.Context, requests: zmq.Socket, output_address: str) -> int:
        """Serve until told to shut down (0) or until something dies (1)."""
        outputs = ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.LINGER, 5000)
        outputs.connect(output_address)
        threads = [
            threading.Thread(target=self._receive, args=(requests,), name="input", daemon=True),
            threading.Thread(target=self._send, args=(outputs,), name="output", daemon=True),
        ]
        if self.engine.executor.sentinels:
            # Worker processes to watch. An in-process worker's faults are exceptions out of
            # step(), which end the loop below.
            threads.append(
                threading.Thread(target=self._watch_workers, name="worker-watch", daemon=True)
            )
        for thread in threads:
            thread.start()
        code = 0
        try:
            self._busy_loop()
        except Exception as error:
            code = 1
            reason = str(error) if isinstance(error, EngineDeadError) else traceback.format_exc()
            logger.error("engine core %d is going down: %s", self.engine_index, reason)
            self.output_queue.put(EngineCoreOutputs(self.engine_index, engine_dead=reason))
        self._shutting_down.set()
        self.output_queue.put(_STOP_SENDING)
        threads[1].join(timeout=5.0)
        try:
            self.engine.shutdown()
        except Exception:
            # An in-process worker that failed a step may fail to stop too; exit all the same.
            logger.exception("engine core %d did not shut down cleanly", self.engine_index)
            code = 1
        return code

    # -- the loop -------------------------------------------------------------------------

    def _busy_loop(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            # An idle loop sleeps until input arrives or a KV transfer times out.
            timeout = engine.kv_timeout() if idle else None
            if not self._handle_inputs(block=idle, timeout=timeout):
                return
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            scheduled = engine.last_scheduler_output
            if scheduled is None and not outputs:
                continue  # async scheduling started a step and applied none
            num_tokens = scheduled.total_num_scheduled_tokens if scheduled is not None else 0
            self.output_queue.put(
                EngineCoreOutputs(
                    self.engine_index,
                    outputs=outputs,
                    scheduler_stats=engine.scheduler_stats(num_tokens),
                    kv_events=engine.take_cache_events(),
                )
            )

    def _handle_inputs(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued adds, aborts and KV events; False once shutdown was asked for."""
        rejected: list[str] = []
        rejected_tenant: list[str] = []
        changed = self.engine.process_kv_events()  # timeouts, even when nothing arrives
        while True:
            try:
                item = self.input_queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            block = False
            if item is _KV_EVENT:
                changed = self.engine.process_kv_events() or changed
                continue
            if item is _GRAMMAR_READY:
                self.engine.wake()
                continue
            if item is _WORKER_DIED:
                self.engine.executor.check_alive()
                raise EngineDeadError("a worker process died")
            kind, payload = item
            if kind is EngineCoreRequestType.SHUTDOWN:
                return False
            changed = True
            if kind is EngineCoreRequestType.ABORT:
                self.engine.abort_requests(payload)
            elif self._queue_full():
                rejected.append(payload.request_id)
            elif self._tenant_queue_full(payload.tenant):
                rejected_tenant.append(payload.request_id)
            else:
                self.engine.add_request(payload)
        if rejected or rejected_tenant or (changed and not self.engine.has_unfinished_requests()):
            # No step follows to report the new state (an abort emptied the engine, or a
            # request was refused): report it now.
            self.output_queue.put(
                EngineCoreOutputs(
                    self.engine_index,
                    scheduler_stats=self.engine.scheduler_stats(),
                    rejected_request_ids=rejected,
                    rejected_tenant_request_ids=rejected_tenant,
                    kv_events=self.engine.take_cache_events(),
                )
            )
        return True

    def _queue_full(self) -> bool:
        limit = self.max_waiting_requests
        return limit is not None and self.engine.scheduler.num_waiting >= limit

    def _tenant_queue_full(self, tenant: str | None) -> bool:
        limit = self.max_waiting_per_tenant
        return limit is not None and self.engine.scheduler.num_waiting_of(tenant) >= limit

    # -- threads ----------------------------------------------------------------------------

    def _receive(self, socket: zmq.Socket) -> None:
        """Decode requests off the socket into the input queue."""
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        try:
            while True:
                kind_frame, payload = socket.recv_multipart(copy=False)
                kind = EngineCoreRequestType(kind_frame.bytes)
                if kind is EngineCoreRequestType.ADD:
                    self.input_queue.put((kind, add_decoder.decode(payload.buffer)))
                elif kind is EngineCoreRequestType.ABORT:
                    self.input_queue.put((kind, abort_decoder.decode(payload.buffer)))
                else:
                    self.input_queue.put((kind, None))
                    return
        except zmq.ZMQError:
            return  # the context is terminating
        finally:
            socket.close(linger=0)

    def _send(self, socket: zmq.Socket) -> None:
        """Encode outputs from the output queue onto the socket."""
        encoder = msgspec.msgpack.Encoder()
        while True:
            item = self.output_queue.get()
            if item is _STOP_SENDING:
                socket.close(linger=5000)
                return
            socket.send(encoder.encode(item), copy=False)

    def _watch_workers(self) -> None:
        """Wake the loop when a worker dies, even while it is idle."""
        import multiprocessing.connection

        multiprocessing.connection.wait(self.engine.executor.sentinels)
        if not self._shutting_down.is_set():
            self.input_queue.put(_WORKER_DIED)
