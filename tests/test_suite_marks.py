"""The module lists in tests/conftest.py that give the suite its marks name real modules: a
renamed file would otherwise lose its mark without a word (a quiet-machine module would run
beside others, a slow one would slip into `make test-quick`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import QUIET_E2E, SLOW_MODULES, STARTS_PROCESSES, TIMING_FREE_E2E

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "listed",
    [QUIET_E2E, TIMING_FREE_E2E, STARTS_PROCESSES, SLOW_MODULES],
    ids=["quiet", "timing-free", "starts-processes", "slow"],
)
def test_every_listed_module_exists(listed):
    missing = sorted(path for path in listed if not (ROOT / path).is_file())
    assert not missing


def test_an_e2e_module_is_quiet_or_timing_free_never_both():
    assert not QUIET_E2E & TIMING_FREE_E2E
    assert all(path.startswith("tests/e2e/") for path in QUIET_E2E | TIMING_FREE_E2E)


def make_test_pytest_lines(**variables: str) -> list[str]:
    """The pytest commands `make test` would run, with these make variables (and no CI set)."""
    env = {k: v for k, v in os.environ.items() if k not in {"CI", "SLOW", "MAKEFLAGS"}}
    command = ["make", "-n", "test", *(f"{k}={v}" for k, v in variables.items())]
    shown = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return [line for line in shown.stdout.splitlines() if "/pytest " in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_leaves_the_slow_tests_out_only_outside_ci():
    local = make_test_pytest_lines()
    assert len(local) == 3 and all('and not slow"' in line for line in local)
    for variables in ({"CI": "true"}, {"SLOW": "1"}):
        everything = make_test_pytest_lines(**variables)
        assert len(everything) == 3 and not any("slow" in line for line in everything)
