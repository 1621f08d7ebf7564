"""The module lists in tests/conftest.py that give the suite its marks name real modules: a
renamed file would otherwise lose its mark without a word (a quiet-machine module would run
beside others, a slow one would slip into `make test-quick`)."""

from __future__ import annotations

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
