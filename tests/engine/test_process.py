"""How many CPUs an engine process may use: affinity and a cgroup v2 quota, not the machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tidegate.common.cpus import available_cpus


@pytest.fixture
def affinity_of_four(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000", 4),  # no quota: the affinity
        ("200000 100000", 2),  # a pod's `cpu: 2`
        ("150000 100000", 2),  # 1.5 CPUs: round up, a thread may idle part of the time
        ("50000 100000", 1),  # half a CPU: still one thread
        ("800000 100000", 4),  # a quota beyond the affinity
    ],
)
def test_a_cgroup_quota_caps_the_affinity(
    tmp_path: Path, affinity_of_four: None, cpu_max: str, expected: int
) -> None:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert available_cpus(str(tmp_path)) == expected


def test_without_a_cgroup_file_the_affinity_counts(tmp_path: Path, affinity_of_four: None) -> None:
    assert available_cpus(str(tmp_path / "missing")) == 4
