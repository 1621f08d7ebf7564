"""One worker inside the calling process: `tidegate serve` and the offline API at one rank."""

from __future__ import annotations

from tidegate.engine.config import EngineArgs
from tidegate.engine.executor.abstract import Executor
from tidegate.engine.messages import KVWorkerConfig, ModelRunnerOutput, SchedulerOutput
from tidegate.engine.model.config import ModelConfig


class UniProcExecutor(Executor):
    """Calls a Worker directly; no processes, no serialization."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        kv_config: KVWorkerConfig | None = None,
    ) -> None:
        super().__init__(args, model_config, max_model_len, kv_config)
        # Imported here so that an engine core with worker processes never imports torch.
        from tidegate.engine.worker.worker import Worker

        self.worker = Worker(args, model_config, max_model_len, kv_config=kv_config)

    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def kv_data_ports(self) -> list[int]:
        return [self.worker.kv_data_port]

    def update_kv_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        self.worker.update_kv_pins(pin, unpin)

    def describe(self) -> str:
        return self.worker.describe()

    def shutdown(self) -> None:
        self.worker.shutdown()
