"""/metrics as the Gateway API Inference Extension's endpoint picker scrapes it (vLLM's names)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.entrypoints.fake_engine import MODEL, SyncAPI
from tidegate.engine.config import EngineArgs, ServerArgs
from tidegate.engine.entrypoints import serve
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.messages import SchedulerStats
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.engine.router.exposition import parse_exposition
from tidegate.engine.router.health import READ_METRICS, revision

# What the endpoint picker reads, by default flag values.
PICKER_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
)


def stats(num_total_blocks: int) -> SchedulerStats:
    return SchedulerStats(
        num_running=1,
        num_waiting=2,
        num_total_blocks=num_total_blocks,
        num_free_blocks=num_total_blocks - 10,
        kv_cache_usage=10 / num_total_blocks,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )


def scrape(metrics: PrometheusMetrics, engine, tiny_llama_dir) -> dict[str, list]:
    """The samples of the app's /metrics page, by name."""
    app = build_app(
        engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), metrics=metrics
    )
    text = SyncAPI(app).get("/metrics").text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_vllm_compat_exports_every_metric_the_endpoint_picker_reads(engine, tiny_llama_dir):
    metrics = PrometheusMetrics(MODEL, compat="vllm")
    metrics.enable_lora(4)
    metrics.record_cache_config(16, True, "bfloat16")
    metrics.record_kv_blocks(5000)
    samples = scrape(metrics, engine, tiny_llama_dir)

    assert all(name in samples for name in PICKER_METRICS), set(PICKER_METRICS) - set(samples)
    [info] = samples["vllm:cache_config_info"]
    assert info.value == 1
    assert info.labels == {
        "model_name": MODEL,
        "engine": "0",
        "block_size": "16",
        "num_gpu_blocks": "5000",
        "cache_dtype": "bfloat16",
        "enable_prefix_caching": "True",
    }
    assert [s.labels for s in samples["tidegate:cache_config_info"]] == [info.labels]


def test_each_engine_core_has_its_cache_config_series(engine, tiny_llama_dir):
    metrics = PrometheusMetrics(MODEL, compat="vllm", num_engines=2)
    metrics.record_cache_config(32, False, "float32")
    # No series before an engine core's number of blocks is known.
    assert "vllm:cache_config_info" not in scrape(metrics, engine, tiny_llama_dir)
    metrics.record_kv_blocks(700, engine=0)
    metrics.record_scheduler_stats(stats(650), engine=1)
    samples = scrape(metrics, engine, tiny_llama_dir)

    for prefix in ("tidegate:", "vllm:"):
        series = {
            s.labels["engine"]: (s.labels["num_gpu_blocks"], s.labels["block_size"])
            for s in samples[prefix + "cache_config_info"]
        }
        assert series == {"0": ("700", "32"), "1": ("650", "32")}
    assert {s.labels["enable_prefix_caching"] for s in samples["vllm:cache_config_info"]} == {
        "False"
    }


def test_without_compat_the_cache_config_is_tidegates_only(engine, tiny_llama_dir):
    metrics = PrometheusMetrics(MODEL)
    metrics.record_scheduler_stats(stats(100))
    metrics.record_cache_config(16, True, "float16")
    samples = scrape(metrics, engine, tiny_llama_dir)

    assert not any(name.startswith("vllm:") for name in samples)
    [info] = samples["tidegate:cache_config_info"]
    assert info.labels["num_gpu_blocks"] == "100"
    assert info.labels["cache_dtype"] == "float16"


@pytest.mark.parametrize(
    ("track", "weight", "label"),
    [("stable", None, ""), ("canary", 0.1, "0.1"), ("canary", 0.3, "0.3")],
)
def test_the_rollout_track_is_an_info_gauge_routers_read(
    engine, tiny_llama_dir, track, weight, label
):
    metrics = PrometheusMetrics(MODEL, compat="vllm")
    metrics.record_revision(track, weight)
    samples = scrape(metrics, engine, tiny_llama_dir)

    [info] = samples["tidegate:revision_info"]
    assert info.value == 1
    assert info.labels == {"model_name": MODEL, "track": track, "traffic_weight": label}
    assert "vllm:revision_info" not in samples  # Tidegate's own: no vLLM twin
    # What a router makes of it (router/health.py).
    app = build_app(
        engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), metrics=metrics
    )
    page = parse_exposition(SyncAPI(app).get("/metrics").text, READ_METRICS)
    assert revision(page) == (track, weight)


@pytest.mark.parametrize(
    ("flags", "label"),
    [
        ({}, ("stable", "")),
        ({"track": "canary"}, ("canary", "0.1")),
        ({"track": "canary", "traffic_weight": 0.25}, ("canary", "0.25")),
    ],
    ids=["stable", "canary-default-weight", "canary-weight"],
)
def test_serve_exports_the_track_from_the_start(monkeypatch, tmp_path, flags, label):
    made: list[PrometheusMetrics] = []

    class Recorded(PrometheusMetrics):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(serve, "PrometheusMetrics", Recorded)
    # No model here: serve gives up at once, the metrics already made.
    engine_args = EngineArgs(model=str(tmp_path / "no-model"), **flags)
    assert asyncio.run(serve._serve(engine_args, ServerArgs())) == 1
    [metrics] = made
    text = metrics.render()[0].decode()
    [info] = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tidegate:revision_info"
    ]
    assert (info.labels["track"], info.labels["traffic_weight"]) == label
