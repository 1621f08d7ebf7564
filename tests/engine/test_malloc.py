"""CPU workers keep step-sized temporaries off mmap, so a decode step does not page-fault."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What a decode step's attention gather does in every layer: a temporary of a few MiB, a
# little larger each step as the contexts grow, touched and freed. glibc's own threshold
# follows each freed size one step behind, so untuned every one of them is a fresh mmap.
PROBE = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from tidegate.engine.worker.malloc import keep_temporaries_off_mmap
    assert keep_temporaries_off_mmap()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(100):
    t = torch.empty((1 << 20) + step * (16 << 10)).fill_(1.0)  # 4 MiB, +64 KiB a step
    del t
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_temporaries_stop_faulting_once_malloc_is_tuned() -> None:
    untuned, tuned = page_faults("plain"), page_faults("tuned")
    # Untuned: about 1,000-2,600 faults per step (every page of every temporary). Tuned: the
    # heap grows by 64 KiB a step, 16 pages, and the memory is reused.
    assert untuned > 100 * 1000
    assert tuned < untuned / 10
