"""`tidegate bench serve` against a real server: every workload completes and is reported."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME
from tidegate.cli import main

WORKLOADS = {
    "random": ["--num-prompts", "12", "--input-len", "8-40", "--output-len", "4-8"],
    "shared-prefix": ["--num-prompts", "8", "--prefix-len", "64", "--output-len", "4"],
    "long-prompt-arrival": [
        "--steady-streams", "3", "--steady-output-len", "120", "--long-input-len", "200",
        "--long-arrivals", "0.6", "--long-output-len", "2",
    ],
}  # fmt: skip


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_bench_serve_reports_latencies_for_every_workload(server, tmp_path, workload):
    out, plot = tmp_path / "result.json", tmp_path / "plot.png"
    code = main(
        [
            "bench", "serve", "--base-url", server.base_url, "--model", SERVED_NAME,
            "--api-key", API_KEY, "--workload", workload, "--request-rate", "20",
            "--slo", "ttft_ms=5000,itl_ms=1000", "--out", str(out), "--plot", str(plot),
            *WORKLOADS[workload],
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())["result"]
    assert result["failed"] == 0 and result["completed"] > 0
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert result[key]["p99"] >= result[key]["p50"] > 0
    assert result["goodput"] > 0
    assert plot.stat().st_size > 10_000
    if workload == "long-prompt-arrival":
        assert result["arrival"]["steady_itl_before_ms"]["count"] > 0
        assert set(result["groups"]) == {"steady", "long"}
