"""How many CPUs this process may really use (a pod's share, not the node's)."""

from __future__ import annotations

import math
import os


def available_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota.

    os.cpu_count() is the machine's; a Kubernetes pod with `cpu: 2` on a 64-core node gets
    a quota of 2 CPUs (cpu.max), and a `taskset` process its affinity. Sizing torch's threads
    by the machine would make every pod oversubscribe its share many times over.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        with open(os.path.join(cgroup_root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))
