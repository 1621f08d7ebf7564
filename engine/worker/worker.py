"""A worker: one model shard on one device, its KV cache, and the steps it runs."""

from __future__ import annotations

import logging
import time

import torch

from tidegate.common.cpus import available_cpus
from tidegate.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineArgs
from tidegate.engine.device import resolve_device
from tidegate.engine.distributed.parallel_state import (
    destroy_parallel,
    get_tp_rank,
    init_parallel,
    is_last_stage,
)
from tidegate.engine.kv_transfer.base import KVConnectorWorker, create_worker_connector
from tidegate.engine.messages import KVWorkerConfig, ModelRunnerOutput, SchedulerOutput
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.worker.fault_injection import StepFaultTrigger
from tidegate.engine.worker.malloc import keep_temporaries_off_mmap
from tidegate.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# On GPUs the cache takes this share of the memory left after the weights.
_GPU_KV_CACHE_FRACTION = 0.9


class Worker:
    """Loads the model onto its device, sizes the KV cache, and executes scheduled steps."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        rank: int = 0,
        distributed_init_method: str | None = None,
        kv_config: KVWorkerConfig | None = None,
        fault: StepFaultTrigger | None = None,
    ) -> None:
        self.args = args
        self.rank = rank
        local_ranks = args.local_world_size  # this node's ranks: consecutive global ranks
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and local_ranks > 1:
            if torch.cuda.device_count() < local_ranks:
                raise ValueError(
                    f"{local_ranks} ranks on this node (tensor_parallel_size x "
                    f"pipeline_parallel_size / nnodes) need {local_ranks} CUDA devices; "
                    f"{torch.cuda.device_count()} are visible"
                )
            self.device = torch.device("cuda", rank % local_ranks)
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            keep_temporaries_off_mmap()
            # The ranks of every engine core on this node share its cores.
            ranks = local_ranks * args.data_parallel_size_local
            torch.set_num_threads(args.num_threads or max(1, available_cpus() // ranks))
        init_parallel(
            rank,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            distributed_init_method or "",
            self.device,
        )
        # The rank that hands the sampled tokens back: TP rank 0 of the last stage.
        self.is_output_rank = is_last_stage() and get_tp_rank() == 0
        start = time.perf_counter()
        self.runner = ModelRunner(args, model_config, max_model_len, self.device)
        if rank == 0:
            logger.info(
                "loaded the model in %.1f s (%d linear weights packed for oneDNN)",
                time.perf_counter() - start,
                self.runner.num_packed_linears,
            )
        # Tests only (TIDEGATE_TEST_FAULT_SIGNAL). Its signal handler needs the main thread:
        # a worker built on another thread is handed one made there.
        self._fault = fault or StepFaultTrigger()
        self.kv_connector: KVConnectorWorker | None = None
        if kv_config is not None:
            self.kv_connector = create_worker_connector(
                kv_config,
                rank,
                args.tensor_parallel_size,
                model_config.num_key_value_heads,
                self.device,
            )

    @property
    def kv_data_port(self) -> int:
        """Where this rank serves KV blocks to consumers (0: it does not)."""
        return self.kv_connector.data_port if self.kv_connector is not None else 0

    def describe(self) -> str:
        """Device, dtype and compilation level, for the startup log line."""
        return (
            f"{self.device}, {self.runner.dtype}, compilation level {self.runner.compilation_level}"
        )

    def num_kv_blocks(self) -> int:
        """How many KV blocks fit in the memory this worker may give the cache."""
        if self.args.num_gpu_blocks is not None:
            return self.args.num_gpu_blocks
        per_block = self.runner.kv_cache_bytes_per_block()
        budget = self.args.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * _GPU_KV_CACHE_FRACTION)
        return max(1, (budget or DEFAULT_KV_CACHE_MEMORY) // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then warm up (compile) the model before any request."""
        self.runner.initialize_kv_cache(num_blocks)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(
                self.runner.kv_caches, self.runner.attn_backend.kv_layout
            )
        seconds = self.runner.warm_up()
        if self.runner.compilation_level > 0 and self.rank == 0:
            logger.info(
                "compilation level %d: warm-up compiled %d graph(s) in %.1f s",
                self.runner.compilation_level,
                self.runner.compiler.num_graphs,
                seconds,
            )
        if self.runner.compilation_level == 2:
            seconds = self.runner.capture_decode_graphs()
            sizes = self.runner.decode_graphs.sizes
            if self.rank == 0:
                logger.info(
                    "captured %d CUDA graph(s) for decode batches of %d to %d in %.1f s",
                    len(sizes),
                    sizes[0],
                    sizes[-1],
                    seconds,
                )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._fault.check()
        meta = scheduler_output.kv_connector_metadata
        if meta is not None and self.kv_connector is not None:
            # Pulled KV lands in the cache before the forward pass that reads it.
            self.kv_connector.handle(meta)
        return self.runner.execute_model(scheduler_output)

    def update_kv_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        if self.kv_connector is not None:
            self.kv_connector.update_pins(pin, unpin)

    def shutdown(self) -> None:
        """Stop the KV connector and leave the tensor-parallel group."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        destroy_parallel()
