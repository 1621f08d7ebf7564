"""The worker process: read commands from the broadcast queue, run them; the output rank (TP
rank 0 of the last pipeline stage) replies with the sampled tokens."""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection

import msgspec

from tidegate.engine.config import EngineArgs
from tidegate.engine.distributed.shm_broadcast import ShmBroadcastReader, ShmQueueHandle
from tidegate.engine.messages import (
    ExecuteModel,
    InitializeKVCache,
    KVPins,
    KVWorkerConfig,
    ShutdownWorker,
    WorkerCommand,
    WorkerFailure,
    WorkerReady,
    WorkerReply,
    WorkerResult,
    WorkerWarmedUp,
)
from tidegate.engine.process import become_child_process

logger = logging.getLogger(__name__)


def run_worker(
    args: EngineArgs,
    max_model_len: int,
    rank: int,
    local_rank: int,
    commands: ShmQueueHandle,
    replies: Connection,
    title: str,
    distributed_init_method: str,
    kv_config: KVWorkerConfig | None = None,
) -> None:
    """Process entry point: load the shard, report readiness, then serve commands until told.

    `rank` is global (over every node); `local_rank` is this node's index, the reader slot of
    its node's broadcast ring.
    """
    become_child_process(title)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(WorkerCommand)

    def reply(message: WorkerReply) -> None:
        replies.send_bytes(encoder.encode(message))

    try:
        # Imported after naming the process: torch takes a second or two to import.
        from tidegate.engine.model.config import ModelConfig
        from tidegate.engine.worker.worker import Worker

        model_config = ModelConfig.from_pretrained(args.model)
        worker = Worker(args, model_config, max_model_len, rank, distributed_init_method, kv_config)
        reader = ShmBroadcastReader(commands, local_rank)
        reply(
            WorkerReady(
                rank=rank, num_kv_blocks=worker.num_kv_blocks(), kv_data_port=worker.kv_data_port
            )
        )
        while True:
            command = decoder.decode(reader.dequeue())
            if isinstance(command, ExecuteModel):
                output = worker.execute_model(command.scheduler_output)
                if worker.is_output_rank:
                    reply(WorkerResult(output=output))
            elif isinstance(command, KVPins):
                worker.update_kv_pins(command.pin, command.unpin)
            elif isinstance(command, InitializeKVCache):
                worker.initialize_kv_cache(command.num_blocks)
                reply(WorkerWarmedUp(rank=rank))
            elif isinstance(command, ShutdownWorker):
                break
        reader.close()
        worker.shutdown()
    except Exception:
        message = traceback.format_exc()
        logger.error("worker %d failed:\n%s", rank, message)
        try:
            reply(WorkerFailure(rank=rank, error=message))
        finally:
            raise SystemExit(1) from None
