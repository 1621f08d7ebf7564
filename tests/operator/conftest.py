"""Fixtures of the operator's end-to-end modules: one kmock emulated cluster per module, and
kopf running the operator's handlers against it. A module that needs other operator flags
overrides `operator_options`; one that starts operators itself uses `run_operator`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import KOPF_LOG, EmulatedCluster, run_operator
from tidegate.operator.handlers import OperatorOptions


@pytest.fixture(scope="module", autouse=True)
def kopf_log() -> Iterator[None]:
    """kopf's per-object lines go to KOPF_LOG while the module runs (settle waits on it)."""
    with KOPF_LOG:
        yield


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path_factory.mktemp("kube")) as emulated:
        yield emulated


@pytest.fixture(scope="module")
def operator_options() -> OperatorOptions:
    """The operator's flags in this module."""
    return OperatorOptions()


@pytest.fixture(scope="module")
def operator(
    cluster: EmulatedCluster, operator_options: OperatorOptions, kopf_log: None
) -> Iterator[KopfRunner]:
    """The module's operator, running until its last test is done; it must end cleanly."""
    with run_operator(cluster, operator_options, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output[-3000:]
