"""Where the workers run: the --distributed-executor-backend flag, and what uni sets up."""

from __future__ import annotations

import os
import signal

import pytest
from pydantic import ValidationError

from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import default_executor_class
from tidegate.engine.executor.multiproc_executor import MultiprocExecutor
from tidegate.engine.executor.uniproc_executor import (
    UniProcExecutor,
)
from tidegate.engine.worker.fault_injection import (
    FAULT_SIGNAL_ENV,
    InjectedStepFault,
    StepFaultTrigger,
)


def test_one_rank_runs_in_process_and_more_ranks_in_worker_processes():
    assert EngineArgs(model="m").executor_backend == "uni"
    assert EngineArgs(model="m", tensor_parallel_size=2).executor_backend == "mp"
    forced = EngineArgs(model="m", distributed_executor_backend="mp")
    assert forced.executor_backend == "mp"
    assert default_executor_class(EngineArgs(model="m")) is UniProcExecutor
    assert default_executor_class(forced) is MultiprocExecutor


def test_uni_with_several_ranks_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match="tensor_parallel_size 2 needs 'mp'"):
        EngineArgs(model="m", tensor_parallel_size=2, distributed_executor_backend="uni")


def test_the_step_fault_fires_once_per_signal_and_only_when_asked_for():
    before = signal.getsignal(signal.SIGUSR1)
    StepFaultTrigger({})
    assert signal.getsignal(signal.SIGUSR1) is before  # unset: nothing installed
    try:
        trigger = StepFaultTrigger({FAULT_SIGNAL_ENV: "USR1"})
        trigger.check()  # not armed yet
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(InjectedStepFault):
            trigger.check()
        trigger.check()  # once per signal
    finally:
        signal.signal(signal.SIGUSR1, before)
