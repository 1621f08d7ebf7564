"""The EngineCore's view of its workers: size the cache, run a step, shut down."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from tidegate.engine.config import EngineArgs
from tidegate.engine.messages import KVWorkerConfig, ModelRunnerOutput, SchedulerOutput
from tidegate.engine.model.config import ModelConfig


class Executor(ABC):
    """Runs the model for the EngineCore, in this process or in worker processes."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        kv_config: KVWorkerConfig | None = None,
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.kv_config = kv_config

    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks every worker can hold (the smallest of their answers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the same number of blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker and return the output rank's sampled tokens."""

    @abstractmethod
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start a step behind any still running and return at once (async scheduling, and
        pipeline micro-batches).

        Each worker runs the steps in the order they were started, each after the one before
        has finished on that worker (with pipeline stages, step N+1 runs in one stage while
        step N runs in the next); their results must be collected in that order too.
        """

    @property
    def takes_deferred_grammar_bitmask(self) -> bool:
        """True when a step may start without its grammar bitmask and be handed it later
        (`deliver_grammar_bitmask`), before it samples: async scheduling in-process."""
        return False

    def deliver_grammar_bitmask(self, bitmask: bytes) -> None:
        """The bitmask of the oldest started step that waits for one."""
        raise NotImplementedError("this executor takes each step's bitmask with the step")

    @abstractmethod
    def kv_data_ports(self) -> list[int]:
        """Where each rank's KV connector serves blocks (producer), by rank."""

    @abstractmethod
    def update_kv_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        """Tell every worker which transfers it may serve, before any later step runs."""

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker process exits (none in-process).

        An in-process worker cannot die on its own: its faults are exceptions raised by the
        call that met them, which end the engine core's loop like a dead worker does.
        """
        return []

    def check_alive(self) -> None:  # noqa: B027 - an in-process worker is alive while we are
        """Raise EngineDeadError if a worker process has exited."""

    @abstractmethod
    def describe(self) -> str:
        """Where the model runs, for the startup log line."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to stop for an in-process worker
        """Stop the workers; idempotent."""
