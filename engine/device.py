"""Which device an engine runs on, and which GPUs each engine core of a pod may see.

A module of its own, below the core and the workers, so that the engine core can place its
workers without importing the worker package, and the data-parallel router stays pure
bookkeeping. torch is imported only when a device is resolved.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tidegate.engine.config import EngineArgs


def resolve_device(name: str) -> torch.device:
    """auto means CUDA when present, else CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is visible")
    return torch.device(name)


def runs_on_cpu(name: str) -> bool:
    """Whether device `name` resolves to the CPU, asked without starting CUDA in this process
    (the engine core's: see use_own_devices); "cuda" with no GPU fails later, in the worker."""
    if name != "auto":
        return name == "cpu"
    import torch

    return torch.cuda.device_count() == 0


def devices_of_core(
    engine_index: int, num_cores: int, devices_per_core: int, visible: list[str]
) -> str:
    """CUDA_VISIBLE_DEVICES of one engine core's workers: its own slice of the visible GPUs."""
    needed = num_cores * devices_per_core
    if len(visible) < needed:
        raise ValueError(
            f"data_parallel_size_local {num_cores} x {devices_per_core} rank(s) per engine core "
            f"needs {needed} CUDA devices; {len(visible)} are visible"
        )
    start = engine_index * devices_per_core
    return ",".join(visible[start : start + devices_per_core])


def use_own_devices(args: EngineArgs, engine_index: int) -> None:
    """On CUDA, give this engine core's workers their GPUs, before CUDA starts in this process.

    Worker processes spawned later inherit the variable. A worker inside this process (uni)
    sees it only if CUDA has not started here yet: CUDA reads CUDA_VISIBLE_DEVICES once, and
    torch.cuda.is_available() starts it. So this asks torch.cuda.device_count(), which counts
    through NVML without starting CUDA, and never is_available().
    """
    import torch

    count = torch.cuda.device_count()
    if args.device == "cpu" or count == 0:
        return  # no GPU: auto means CPU, and device "cuda" fails in resolve_device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    os.environ["CUDA_VISIBLE_DEVICES"] = devices_of_core(
        engine_index, args.data_parallel_size_local, args.local_world_size, ids
    )
