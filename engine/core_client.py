"""The API server's end of an engine core: start the process, talk ZMQ, notice its death."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from tidegate.engine.allocator import child_environment
from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core_proc import FAILED, READY, run_engine_core
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
)

logger = logging.getLogger(__name__)

# How long an engine core may take to finish its requests' step and stop when told to.
_SHUTDOWN_GRACE_S = 10.0


class EngineCoreClient:
    """Owns one EngineCore process and the two sockets to it (requests out, outputs in)."""

    def __init__(
        self,
        args: EngineArgs,
        engine_index: int = 0,
        max_waiting_requests: int | None = None,
        max_waiting_per_tenant: int | None = None,
    ) -> None:
        self.args = args
        self.engine_index = engine_index
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.identity = engine_index.to_bytes(2, "little")
        self._ctx = zmq.asyncio.Context()
        if sys.platform == "linux":
            # Abstract sockets: no file to clean up, whatever kills us.
            self._dir = None
            base = f"ipc://@tidegate-{os.getpid()}-{uuid.uuid4().hex[:12]}-"
        else:
            self._dir = tempfile.mkdtemp(prefix="tidegate-")
            base = f"ipc://{self._dir}/"
        self.input_address, self.output_address = base + "input", base + "output"
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.bind(self.input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(self.output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None
        self._on_death: Callable[[str], None] | None = None
        self._stopping = False

    async def start(self, on_death: Callable[[str], None]) -> EngineCoreReady:
        """Spawn the engine core and wait for its handshake; raise if it fails to start."""
        self._on_death = on_death
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core,
            args=(
                self.args,
                self.engine_index,
                self.input_address,
                self.output_address,
                self.max_waiting_requests,
                self.max_waiting_per_tenant,
            ),
            name=f"tidegate::engine_core_{self.engine_index}",
            daemon=False,
        )
        with child_environment(self.args.cpu_allocator, self.args.device):
            self.process.start()
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self.process.sentinel, lambda: exited.done() or exited.set_result(None))
        handshake = asyncio.ensure_future(self._input.recv_multipart())
        await asyncio.wait({handshake, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not handshake.done():
            handshake.cancel()
            self.process.join()
            raise RuntimeError(
                f"the engine core exited with code {self.process.exitcode} while starting"
            )
        _identity, kind, payload = handshake.result()
        if kind == FAILED:
            self.process.join(timeout=_SHUTDOWN_GRACE_S)
            raise RuntimeError(f"the engine core failed to start: {payload.decode()}")
        assert kind == READY, kind
        # From now on the exit of the process is a death unless we asked for it.
        loop.remove_reader(self.process.sentinel)
        loop.add_reader(self.process.sentinel, self._process_exited)
        return msgspec.msgpack.decode(payload, type=EngineCoreReady)

    def _process_exited(self) -> None:
        assert self.process is not None
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(timeout=1.0)
        if self._stopping:
            return
        self.mark_dead(
            f"the engine core process (pid {self.process.pid}) exited with code "
            f"{self.process.exitcode}"
        )

    def mark_dead(self, reason: str) -> None:
        """Record the first cause of death and tell the owner once."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        if self._on_death is not None:
            self._on_death(reason)

    async def _send(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        try:
            await self._input.send_multipart([self.identity, kind.value, payload], copy=False)
        except zmq.ZMQError as error:
            # ROUTER_MANDATORY: the core's socket is gone, so the core died, even if the
            # process watcher has not said so yet (a send racing the kill gave a 500).
            raise EngineDeadError(f"the engine core is unreachable ({error})") from error

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Hand a validated request to the engine core."""
        await self._send(EngineCoreRequestType.ADD, self._encoder.encode(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests in the engine core and free their KV blocks."""
        if request_ids and self.dead_reason is None:
            with contextlib.suppress(EngineDeadError):  # a dead core has nothing to abort
                await self._send(EngineCoreRequestType.ABORT, self._encoder.encode(request_ids))

    async def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (one engine step, or an admission/abort report)."""
        return self._decoder.decode(await self._output.recv(copy=False))

    async def shutdown(self) -> None:
        """Ask the engine core to stop its workers and exit; kill it if it does not."""
        self._stopping = True
        process = self.process
        if process is not None and process.exitcode is None:
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                await self._send(EngineCoreRequestType.SHUTDOWN, b"")
            await asyncio.get_running_loop().run_in_executor(None, process.join, _SHUTDOWN_GRACE_S)
            if process.exitcode is None:
                logger.warning("engine core pid %d did not stop; terminating it", process.pid)
                process.terminate()
                process.join(timeout=_SHUTDOWN_GRACE_S)
        if process is not None:
            logger.info("engine core pid %d exited with code %s", process.pid, process.exitcode)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
