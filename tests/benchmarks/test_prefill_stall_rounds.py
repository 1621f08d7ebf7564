"""benchmarks/prefill_stall.py --repeats: medians over rounds, and the median round shown."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def stall():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("prefill_stall")
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in ("prefill_stall", "common"):  # top-level names of the scripts' folder
            sys.modules.pop(name, None)


def fake_round(stall, ratio, alone):
    results = {stall.AUTO: {"arrival": {"p99_ratio_during_vs_before": ratio}}}
    return results, {"records": ratio}, {"ratio": ratio, "alone": alone}


def test_targets_are_medians_and_the_table_is_the_median_round(stall):
    rounds = [
        fake_round(stall, 1.9, 1.4),
        fake_round(stall, 1.55, 1.2),
        fake_round(stall, 1.6, 1.3),
    ]
    assert stall._median([1.9, 1.55, 1.6]) == 1.6
    assert stall._median([None, 2.0, 1.0]) == 1.5  # a round too short to measure is left out
    assert stall._median([None]) is None
    results, runs, targets = stall._median_round(rounds)
    assert results[stall.AUTO]["arrival"]["p99_ratio_during_vs_before"] == 1.6
    assert runs == {"records": 1.6} and targets["alone"] == 1.3
    # A round with no ratio sorts last, never as the median of two measured ones.
    _, runs, _ = stall._median_round([fake_round(stall, None, None), *rounds[:2]])
    assert runs == {"records": 1.9}


def test_the_readme_line_lists_every_round_when_there_are_several(stall):
    rounds = [
        fake_round(stall, 1.9, 1.4),
        fake_round(stall, 1.55, 1.2),
        fake_round(stall, 1.6, 1.3),
    ]
    line = stall._target_line("ratio", 1.6, rounds)
    assert line.startswith("- ratio: **1.6** (median of 3 rounds: 1.9, 1.55, 1.6")
    assert stall._target_line("ratio", 1.6, rounds[:1]) == "- ratio: **1.6**"
