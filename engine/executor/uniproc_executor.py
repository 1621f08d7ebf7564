"""One worker inside the calling process: `tidegate serve` and the offline API at one rank."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from tidegate.engine.config import EngineArgs
from tidegate.engine.executor.abstract import Executor
from tidegate.engine.messages import KVWorkerConfig, ModelRunnerOutput, SchedulerOutput
from tidegate.engine.model.config import ModelConfig

T = TypeVar("T")


class UniProcExecutor(Executor):
    """Calls a Worker directly; no processes, no serialization.

    With async scheduling the worker lives on a thread of its own, from loading to shutdown,
    and runs the steps there in order while the caller plans the next one. It is built on that
    thread too: torch ops in a thread that is not the one that first ran them are about 40%
    slower here, with two OpenMP teams on the same cores (the small model's decode step,
    16 -> 25 ms; benchmarks/README.md, async scheduling).
    """

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        kv_config: KVWorkerConfig | None = None,
    ) -> None:
        super().__init__(args, model_config, max_model_len, kv_config)
        # Imported here so that an engine core with worker processes never imports torch.
        from tidegate.engine.worker.fault_injection import StepFaultTrigger
        from tidegate.engine.worker.worker import Worker

        self._thread: _WorkerThread | None = _WorkerThread() if args.async_scheduling else None
        self.worker = self._call(
            Worker, args, model_config, max_model_len, kv_config=kv_config, fault=StepFaultTrigger()
        )

    def _call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run fn where the worker runs, after any step still running, and wait for it."""
        if self._thread is None:
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def num_kv_blocks(self) -> int:
        return self._call(self.worker.num_kv_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call(self.worker.initialize_kv_cache, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call(self.worker.execute_model, scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._thread is None:
            raise RuntimeError("execute_model_async needs an executor built for async scheduling")
        return self._thread.submit(self.worker.execute_model, scheduler_output)

    @property
    def takes_deferred_grammar_bitmask(self) -> bool:
        # The worker thread runs a step's forward pass, then waits for its bitmask.
        return self._thread is not None

    def deliver_grammar_bitmask(self, bitmask: bytes) -> None:
        # Not queued behind the steps: the step that waits for it is running.
        self.worker.runner.deferred_bitmasks.put(bitmask)

    def kv_data_ports(self) -> list[int]:
        return [self.worker.kv_data_port]

    def update_kv_pins(self, pin: dict[str, list[int]], unpin: list[str]) -> None:
        # Not queued behind the steps: the connector takes its lock, and a pin must be in
        # place before the outputs that name it go out (a read that overtakes it waits).
        self.worker.update_kv_pins(pin, unpin)

    def describe(self) -> str:
        return self.worker.describe()

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            # Behind any step still running: the worker is not torn down under it.
            self._call(worker.shutdown)
        if self._thread is not None:
            self._thread.stop()


class _WorkerThread:
    """One thread that runs calls in the order they were submitted (a daemon: a process that
    exits without shutting the engine down is not held up by it)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> Future[T]:
        future: Future[T] = Future()
        if not self._thread.is_alive():  # stopped: run here (shutdown at interpreter exit)
            future.set_result(fn(*args, **kwargs))
        else:
            self._calls.put((future, fn, args, kwargs))
        return future

    def stop(self) -> None:
        """Finish the calls already submitted, then end the thread."""
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:
                future.set_exception(error)
