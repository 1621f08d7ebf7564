"""A fault for tests: the next model step raises, when the process gets a signal.

A worker process's death is shown by killing the process. A worker inside the engine core
(`--distributed-executor-backend uni`) has no process of its own: its faults are exceptions
out of a step, and the tests need a way to cause one while requests are in flight. With
TIDEGATE_TEST_FAULT_SIGNAL=USR1 in its environment, the process that runs the model arms a
fault on SIGUSR1, and its next step raises `InjectedStepFault` from inside `execute_model`.
Unset, as in every deployment, nothing is installed and the signal keeps its default action.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping

FAULT_SIGNAL_ENV = "TIDEGATE_TEST_FAULT_SIGNAL"


class InjectedStepFault(RuntimeError):
    """The fault a test asked for with TIDEGATE_TEST_FAULT_SIGNAL."""


class StepFaultTrigger:
    """Armed by the signal named in the environment; `check` raises once per arming."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self.armed = False
        name = environ.get(FAULT_SIGNAL_ENV, "")
        # Python runs signal handlers on the main thread, and only it may install them.
        if name and threading.current_thread() is threading.main_thread():
            signal.signal(signal.Signals["SIG" + name.removeprefix("SIG")], self._arm)

    def _arm(self, signum: int, frame: object) -> None:
        self.armed = True

    def check(self) -> None:
        """Raise if a fault was asked for since the last step."""
        if self.armed:
            self.armed = False
            raise InjectedStepFault(f"a step fault injected by {FAULT_SIGNAL_ENV}")
