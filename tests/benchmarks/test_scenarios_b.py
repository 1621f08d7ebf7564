"""More benchmark scenarios in smoke mode (tiny model, seconds), end to end: a file of their
own so that `make test`'s two workers, which take whole files, each run part of the
scenarios (tests/benchmarks/test_scenarios.py has the others)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.test_scenarios import BENCHMARKS


@pytest.mark.slow
def test_disaggregated_kv_encryption_compares_plain_and_curve(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nhand-written text stays\n")
    command = [sys.executable, str(BENCHMARKS / "disaggregated.py"), "--smoke", "--kv-encryption"]
    command += ["--repeats", "1", "--out-dir", str(tmp_path), "--readme", str(readme)]
    subprocess.run(command, check=True, timeout=300)
    result = json.loads((tmp_path / "disaggregated_encryption.json").read_text())
    assert set(result["summary"]) == {"none", "curve"}
    for runs in result["runs"].values():
        (run,) = runs
        assert run["failed"] == 0 and run["groups"]["long"]["ttft_ms"]["count"] == 2
        # Every prompt's KV was pulled, encrypted or not: none was computed on the consumer.
        assert run["pulls"]["count"] > 0 and run["pulls"]["fallbacks"] == 0
    assert all(arm["transport_mib_per_s"] > 0 for arm in result["summary"].values())
    assert "<!-- disaggregated_encryption -->" in readme.read_text()


@pytest.mark.slow
def test_closed_loop_tuning_sweeps_fixed_thresholds_then_fits_and_proposes(tmp_path):
    readme = tmp_path / "README.md"
    command = [sys.executable, str(BENCHMARKS / "closed_loop_tuning.py"), "--smoke"]
    subprocess.run(
        [*command, "--out-dir", str(tmp_path), "--readme", str(readme)], check=True, timeout=300
    )
    result = json.loads((tmp_path / "closed_loop_tuning.json").read_text())
    assert set(result["sweep"]) == {"64", "1024"}
    runs = [*result["sweep"].values(), *result["closed_loop"]["iterations"]]
    for run in runs:
        assert run["failed"] == 0 and run["output_token_throughput"] > 0
        assert run["itl_ms"]["p99"] > 0
        # The window's steps were scraped, and each kind's share over the SLO read.
        assert run["steps"]["decode"]["steps"] > 0 and run["steps"]["mixed"]["steps"] > 0
        assert run["proposal"]["reason"]
    loop = result["closed_loop"]
    assert loop["start"] == 1024 and loop["iterations"][0]["threshold"] == 1024
    first = loop["iterations"][0]
    assert first["fit"]["ok"], first["fit"]["reason"]
    assert first["fit"]["per_token_ms"] > 0 and first["proposal"]["change"]
    assert first["proposal"]["threshold"] % 16 == 0
    if len(loop["iterations"]) > 1:  # the loop restarted the engine with the proposal
        assert loop["iterations"][1]["threshold"] == first["proposal"]["threshold"]
    assert result["slo"]["itl_ms"] > 0 and result["slo"]["why"]
    assert len(result["machine"]["load_average_at_end"]) == 3
    assert "target met" in result["targets"]
    assert not readme.exists()  # a smoke run leaves the results table alone


@pytest.mark.slow
def test_pipeline_parallel_times_stages_with_and_without_micro_batches(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "pipeline_parallel.py"), "--smoke"]
    subprocess.run([*command, "--out-dir", str(tmp_path)], check=True, timeout=300)
    result = json.loads((tmp_path / "pipeline_parallel.json").read_text())
    assert set(result["results"]) == {"pp1", "pp2", "pp2-sync"}
    for name, run in result["results"].items():
        assert run["tokens_match_pp1"] is True and run["sequences_differing"] == 0
        assert run["output_tokens_per_s"] > 0
        if name != "pp1":
            # Each stage's worker was busy for part of the run, and idle for the rest.
            assert len(run["stage_busy"]) == 2 and 0 < run["bubble"] < 1
    assert len(result["load_average_1m_per_turn"]) == 3


@pytest.mark.slow
def test_tenant_fairness_runs_b_alone_and_beside_a_flood_under_fcfs_and_fair(tmp_path):
    readme = tmp_path / "README.md"
    command = [sys.executable, str(BENCHMARKS / "tenant_fairness.py"), "--smoke", "--out-dir"]
    subprocess.run([*command, str(tmp_path), "--readme", str(readme)], check=True, timeout=300)
    result = json.loads((tmp_path / "tenant_fairness.json").read_text())
    assert set(result["results"]) == {
        "B alone",
        "A floods, fcfs",
        "A floods, fair",
        "A floods, fair, running cap",
    }
    for run in result["results"].values():
        assert run["b"]["failed"] == 0 and run["b"]["ttft_ms"]["count"] == 6
        assert "--scheduling-policy" in run["flags"]
    assert result["results"]["B alone"]["a_completed"] == 0
    assert result["results"]["A floods, fair"]["a_completed"] > 0
    assert len(result["targets"]) == 4
    assert len(result["targets"]["fair, each round: B TTFT p99 / B alone"]) == 1  # one round
    assert all(len(run["rounds"]) == 1 for run in result["results"].values())
    assert "--max-running-per-tenant" in result["results"]["A floods, fair, running cap"]["flags"]
    assert result["machine"]["load_average_1m_at_start"] >= 0
    assert "<!-- tenant-fairness -->" in readme.read_text()
