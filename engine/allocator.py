"""Which malloc the engine processes run on: tcmalloc on CPU where the machine has it.

On CPU every step allocates and frees the same few hundred activation buffers (a few KiB to
tens of MiB each). glibc's malloc serves them from bins that hand back a different block
each time; tcmalloc keeps freed blocks per size class and returns the one freed last, still
warm in cache. On the small model (bf16, 2 cores) that is worth a few percent offline and
more under serving load (benchmarks/README.md, "malloc"). vLLM's CPU build asks for the same
library.

A running process cannot change its malloc, so the choice is made by whoever spawns the
engine core: `child_environment` puts the library in LD_PRELOAD for the spawn only, and
the worker processes the engine core spawns inherit it. The API server keeps glibc: it
allocates little. `LLM` runs the engine in its own process, so it keeps whatever malloc the
program started with (start Python with LD_PRELOAD to give it tcmalloc).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from tidegate.engine.config import CpuAllocator

# gperftools' allocator without the heap profiler (Debian: libtcmalloc-minimal4, renamed
# libtcmalloc-minimal4t64 in Debian 13), then the full library (libgoogle-perftools4).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/local/lib",
    "/usr/lib",
)
# Names of mallocs a user may already have preloaded; theirs wins.
_PRELOADED_MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")


def find_tcmalloc(dirs: Sequence[str] = LIBRARY_DIRS) -> str | None:
    """The path of a tcmalloc shared library in the usual library folders, or None."""
    for name in TCMALLOC_NAMES:
        for folder in dirs:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def runs_on_cpu(device: str) -> bool:
    """Whether an engine of this `device` setting runs on CPU, judged without importing torch.

    "auto" means CPU unless an NVIDIA GPU is visible: the driver's device node exists and
    CUDA_VISIBLE_DEVICES does not hide every device.
    """
    if device != "auto":
        return device == "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    return not Path("/dev/nvidiactl").exists()


def preload_for(
    allocator: CpuAllocator,
    device: str,
    current_preload: str = "",
    dirs: Sequence[str] = LIBRARY_DIRS,
) -> str | None:
    """The LD_PRELOAD an engine core should be spawned with, or None to leave it as it is.

    Raises ValueError when tcmalloc is asked for by name and this machine has none.
    """
    if allocator == "system":
        return None
    if any(name in current_preload for name in _PRELOADED_MALLOCS):
        return None
    if allocator == "auto" and not runs_on_cpu(device):
        return None
    path = find_tcmalloc(dirs)
    if path is None:
        if allocator == "tcmalloc":
            raise ValueError(
                "cpu_allocator 'tcmalloc' needs libtcmalloc_minimal.so.4 (Debian and Ubuntu: "
                "apt-get install libtcmalloc-minimal4, or libtcmalloc-minimal4t64 on Debian "
                f"13); none in {', '.join(dirs)}. "
                "'auto' falls back to the system malloc"
            )
        return None
    return f"{path}:{current_preload}" if current_preload else path


@contextlib.contextmanager
def child_environment(allocator: CpuAllocator, device: str) -> Iterator[None]:
    """Within the block, processes spawned get tcmalloc in LD_PRELOAD (as `preload_for` says).

    The variable is restored afterwards, so this process's other children are unaffected.
    Spawning copies the environment when the child is forked, before `start()` returns.
    """
    before = os.environ.get("LD_PRELOAD")
    preload = preload_for(allocator, device, before or "", LIBRARY_DIRS)
    if preload is None:
        yield
        return
    os.environ["LD_PRELOAD"] = preload
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def allocator_in_use(maps: str = "/proc/self/maps") -> str:
    """The malloc this process runs on: "tcmalloc", "jemalloc", "mimalloc" or "system"."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "system"
    for name in _PRELOADED_MALLOCS:
        if f"lib{name}" in text:
            return name
    return "system"
