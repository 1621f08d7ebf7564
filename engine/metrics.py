"""Prometheus metrics of the API server, named like vLLM's under `tidegate:`.

With `compat="vllm"` every metric is also exported under its `vllm:` name, so Grafana
dashboards, KEDA scalers and the Gateway API Inference Extension built for vLLM read Tidegate
unchanged. Each metric is declared once in `METRICS` and created once per prefix; every series
carries `model_name` and `engine` labels, as vLLM's do. With data parallelism each engine core
has its own series: its SchedulerStats, and the requests it served, under `engine="<index>"`.
Beside `METRICS`, info gauges in vLLM's form (`lora_requests_info`, `cache_config_info`) carry
their state in labels.

Step metrics (Tidegate's own, under `tidegate:` only: no vLLM server has them) describe each
engine core's steps so that an operator can fit what a step costs from counters alone:
`step_count`, `step_seconds`, `step_prompt_tokens` and `step_decodes` (counters, `_total`)
are labelled by the class of prompt tokens and of decodes the step carried
(`prompt_tokens`: "0", "1-64", ..., "16385+"; `decodes`: "0", "1-4", ..., "257+"; fixed
bounds, so series of several pods and engine cores add up), and `step_duration_seconds{kind}`
is a histogram of step seconds by whether the step carried a prompt chunk beside decodes
(`decode`, `mixed`, or `prefill`: prompt tokens and no decode, which no stream waits on).
The sums' increases over a window, per class, give mean step seconds, prompt tokens and
decodes, to which operator/step_fit.py fits seconds = base + per_decode x decodes +
per_token x prompt_tokens; the histogram gives the share of steps over an ITL SLO. A series
of the counters appears with the first step of its class.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tidegate.engine.messages import SchedulerStats

# fmt: off
# vLLM's TTFT buckets: from 1 ms up to the minutes a long prompt behind a queue can take.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's start at 10 ms; a small model on a fast GPU decodes a token in a few.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Whole requests and time in the queue: a few ms (idle server) to hours (huge batch jobs).
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                   20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
# Token counts: powers of two up to 128Ki, beyond any context length we serve today.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(18))

# fmt: off
# Step wall times: fine around the ITL SLOs users set (10 ms to a few hundred), so that the
# share of steps over one is read at a bound or interpolated over a narrow bucket.
STEP_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
                3.0, 5.0, 10.0)
# fmt: on
# Class bounds of the step counters: a class holds the values up to its bound, after the
# previous one ("0", "1-64", "65-256", ...); the last class is open ("16385+").
STEP_PROMPT_TOKEN_BOUNDS = (0, 64, 256, 1024, 4096, 16384)
STEP_DECODE_BOUNDS = (0, 4, 16, 64, 256)
STEP_KINDS = ("decode", "mixed", "prefill")


def class_labels(bounds: tuple[int, ...]) -> tuple[str, ...]:
    """The label of each class of `bounds`: "0", then "a-b" up to each bound, then "n+"."""
    middle = [f"{low + 1}-{high}" for low, high in itertools.pairwise(bounds)]
    return (str(bounds[0]), *middle, f"{bounds[-1] + 1}+")


STEP_PROMPT_TOKEN_CLASSES = class_labels(STEP_PROMPT_TOKEN_BOUNDS)
STEP_DECODE_CLASSES = class_labels(STEP_DECODE_BOUNDS)
# The step counters: name without prefix, help text.
STEP_COUNTERS = (
    ("step_count", "Engine steps executed, by the prompt tokens and decodes they carried."),
    ("step_seconds", "Wall seconds of those steps (schedule, model, update), summed."),
    ("step_prompt_tokens", "Prompt tokens those steps computed, summed."),
    ("step_decodes", "Decodes (one token past a prompt) those steps computed, summed."),
)

FINISH_REASONS = ("stop", "length", "abort")
# Why a prefill leg this decode server ran itself (--prefill-via-header) gave no KV to pull:
# no connection (or it dropped), no answer in time, a 5xx, an answer without usable
# kv_transfer_params, a host --prefill-hosts does not allow (nothing was sent). Each time the
# prompt was computed here instead.
PREFILL_FALLBACK_REASONS = (
    "unreachable",
    "timeout",
    "server_error",
    "bad_response",
    "not_allowed",
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name without prefix, kind, help text, buckets and extra labels."""

    name: str
    kind: type[Gauge] | type[Counter] | type[Histogram]
    documentation: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()


METRICS = (
    MetricSpec("num_requests_running", Gauge, "Number of requests in model execution batches."),
    MetricSpec("num_requests_waiting", Gauge, "Number of requests waiting to be processed."),
    MetricSpec("kv_cache_usage_perc", Gauge, "KV-cache usage: 1 means 100 percent usage."),
    # Not in vLLM: the high-water mark of kv_cache_usage_perc since the engine started, which
    # a scrape every few seconds cannot see when requests come and go between scrapes.
    MetricSpec(
        "kv_cache_usage_peak_perc", Gauge, "Highest KV-cache usage since the engine started."
    ),
    MetricSpec("prefix_cache_queries", Counter, "Prefix cache queries, in queried tokens."),
    MetricSpec("prefix_cache_hits", Counter, "Prefix cache hits, in cached tokens."),
    MetricSpec("num_preemptions", Counter, "Cumulative number of preemptions."),
    # Not in vLLM: prompt tokens whose KV was computed, not read from the prefix cache
    # (recomputation after preemption included). What prefix caching saves, directly.
    MetricSpec("prompt_tokens_computed", Counter, "Prompt tokens computed by the model."),
    # Speculative decoding (vLLM's names): the acceptance rate is accepted / draft tokens.
    MetricSpec("spec_decode_num_drafts", Counter, "Number of spec decoding drafts."),
    MetricSpec("spec_decode_num_draft_tokens", Counter, "Number of draft tokens."),
    MetricSpec("spec_decode_num_accepted_tokens", Counter, "Number of accepted tokens."),
    MetricSpec("prompt_tokens", Counter, "Number of prefill tokens processed."),
    MetricSpec("generation_tokens", Counter, "Number of generation tokens processed."),
    MetricSpec(
        "request_success", Counter, "Count of finished requests.", labels=("finished_reason",)
    ),
    MetricSpec(
        "time_to_first_token_seconds", Histogram, "Time to first token in seconds.", TTFT_BUCKETS
    ),
    MetricSpec(
        "inter_token_latency_seconds", Histogram, "Inter-token latency in seconds.", ITL_BUCKETS
    ),
    MetricSpec(
        "e2e_request_latency_seconds",
        Histogram,
        "End-to-end request latency in seconds.",
        REQUEST_BUCKETS,
    ),
    MetricSpec(
        "request_queue_time_seconds",
        Histogram,
        "Time spent in the waiting queue, in seconds.",
        REQUEST_BUCKETS,
    ),
    # vLLM's name really ends in _total although it is a histogram; dashboards query it so.
    MetricSpec(
        "iteration_tokens_total", Histogram, "Number of tokens per engine step.", TOKEN_BUCKETS
    ),
    MetricSpec(
        "request_prompt_tokens", Histogram, "Number of prefill tokens per request.", TOKEN_BUCKETS
    ),
    MetricSpec(
        "request_generation_tokens",
        Histogram,
        "Number of generation tokens per request.",
        TOKEN_BUCKETS,
    ),
    # Disaggregated prefill/decode (Tidegate's own).
    MetricSpec(
        "kv_pinned_blocks", Gauge, "KV blocks a producer holds until a consumer has read them."
    ),
    MetricSpec(
        "kv_pins_expired", Counter, "Pinned transfers freed by the timeout, not by a consumer."
    ),
    MetricSpec("kv_received_bytes", Counter, "Bytes of KV pulled from producers."),
    MetricSpec(
        "kv_transfer_fallbacks",
        Counter,
        "Pulls that failed or timed out; the prompt was computed locally instead.",
    ),
    MetricSpec(
        "kv_transfer_latency_seconds",
        Histogram,
        "Seconds from asking a producer for a prompt's KV to having all of it.",
        ITL_BUCKETS,
    ),
)

# SchedulerStats totals that feed counters of the same name.
_STATS_TOTALS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens_computed",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "kv_pins_expired",
    "kv_received_bytes",
    "kv_transfer_fallbacks",
)


class PrometheusMetrics:
    """The metrics of one served model and its engine cores, in their own registry."""

    def __init__(
        self,
        model_name: str,
        compat: Literal["none", "vllm"] = "none",
        engine_index: int = 0,
        num_engines: int = 1,
    ) -> None:
        if compat not in ("none", "vllm"):
            raise ValueError(f"compat is {compat!r}; allowed: 'none', 'vllm'")
        self.registry = CollectorRegistry()
        prefixes = ("tidegate:", "vllm:") if compat == "vllm" else ("tidegate:",)
        self._prefixes = prefixes
        # LoRA (enable_lora): vLLM's info gauge, and which adapters this server serves.
        self._lora_info: list[Any] = []
        self._lora_ready: Any = None
        self._max_loras = 0
        self._lora_by_engine: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
        # The KV cache as vLLM's cache_config_info describes it: its settings, and each engine
        # core's number of blocks.
        self._cache_info: list[Any] = []
        self._cache_config: dict[str, str] = {}
        self._kv_blocks: dict[int, int] = {}
        # With --prefill-via-header: the prefill legs that gave no KV, by reason.
        self._prefill_fallbacks: Any = None
        self._model_name = model_name
        self._default_engine = engine_index
        # Metric name -> the same metric under each prefix.
        self._families: dict[str, list[Any]] = {
            spec.name: [self._create(prefix, spec) for prefix in prefixes] for spec in METRICS
        }
        # (name, extra label values) -> labelled series under each prefix.
        self._series_cache: dict[tuple[str, ...], list[Any]] = {}
        # Engine index -> its SchedulerStats totals last seen.
        self._last_totals: dict[int, dict[str, int]] = {}
        # Step metrics: the counters by (engine, prompt class, decode class), created with their
        # first step, and the histogram's series by (engine, kind).
        labels = ("model_name", "engine", "prompt_tokens", "decodes")
        self._step_counters = [
            Counter("tidegate:" + name, doc, labelnames=labels, registry=self.registry)
            for name, doc in STEP_COUNTERS
        ]
        self._step_duration = Histogram(
            "tidegate:step_duration_seconds",
            "Wall seconds of one engine step, by kind: decode (decodes only), mixed (a prompt "
            "chunk beside decodes) or prefill (prompt tokens, no decode).",
            labelnames=("model_name", "engine", "kind"),
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self._step_series: dict[tuple[int, int, int], tuple[Any, ...]] = {}
        self._step_kinds: dict[tuple[int, str], Any] = {}
        # Every series exists from the start, so dashboards and scalers read 0, not "no data".
        for engine in range(engine_index, engine_index + num_engines):
            for spec in METRICS:
                if not spec.labels:
                    self._series(spec.name, engine)
            for reason in FINISH_REASONS:
                self._series("request_success", engine, finished_reason=reason)
            for kind in STEP_KINDS:
                self._step_kind(engine, kind)

    def _create(self, prefix: str, spec: MetricSpec) -> Any:
        kwargs: dict[str, Any] = {"buckets": spec.buckets} if spec.buckets else {}
        return spec.kind(
            prefix + spec.name,
            spec.documentation,
            labelnames=("model_name", "engine", *spec.labels),
            registry=self.registry,
            **kwargs,
        )

    def _series(self, name: str, engine: int | None = None, **labels: str) -> list[Any]:
        engine = self._default_engine if engine is None else engine
        key = (name, str(engine), *labels.values())
        series = self._series_cache.get(key)
        if series is None:
            base = {"model_name": self._model_name, "engine": str(engine)}
            series = [m.labels(**base, **labels) for m in self._families[name]]
            self._series_cache[key] = series
        return series

    def _set(self, name: str, value: float, engine: int | None) -> None:
        for series in self._series(name, engine):
            series.set(value)

    def _inc(self, name: str, amount: float, engine: int | None, **labels: str) -> None:
        for series in self._series(name, engine, **labels):
            series.inc(amount)

    def _observe(self, name: str, value: float, engine: int | None) -> None:
        for series in self._series(name, engine):
            series.observe(value)

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int | None = None) -> None:
        """Set one engine's gauges, advance its counters by the growth of its totals."""
        engine = self._default_engine if engine is None else engine
        self._set("num_requests_running", stats.num_running, engine)
        self._set("num_requests_waiting", stats.num_waiting, engine)
        self._set("kv_cache_usage_perc", stats.kv_cache_usage, engine)
        self._set("kv_cache_usage_peak_perc", stats.kv_cache_usage_peak, engine)
        self._set("kv_pinned_blocks", stats.kv_pinned_blocks, engine)
        for seconds in stats.kv_transfer_latencies:
            self._observe("kv_transfer_latency_seconds", seconds, engine)
        last_totals = self._last_totals.setdefault(engine, dict.fromkeys(_STATS_TOTALS, 0))
        for name in _STATS_TOTALS:
            total = getattr(stats, name)
            last = last_totals[name]
            # A total below the last one means the engine restarted and counts from 0 again.
            self._inc(name, total - last if total >= last else total, engine)
            last_totals[name] = total
        if stats.num_batched_tokens > 0:
            self._observe("iteration_tokens_total", stats.num_batched_tokens, engine)
        for step in stats.steps:
            self.record_step(step.seconds, step.decodes, step.prompt_tokens, engine)
        self.record_kv_blocks(stats.num_total_blocks, engine)
        if self._lora_info:
            self._lora_by_engine[engine] = (
                stats.running_lora_adapters,
                stats.waiting_lora_adapters,
            )
            self._record_lora_requests()

    # -- engine steps ----------------------------------------------------------------------

    def record_step(
        self, seconds: float, decodes: int, prompt_tokens: int, engine: int | None = None
    ) -> None:
        """Count one engine step in its class and observe its seconds."""
        engine = self._default_engine if engine is None else engine
        key = (
            engine,
            bisect.bisect_left(STEP_PROMPT_TOKEN_BOUNDS, prompt_tokens),
            bisect.bisect_left(STEP_DECODE_BOUNDS, decodes),
        )
        series = self._step_series.get(key)
        if series is None:
            series = self._step_series[key] = tuple(
                counter.labels(
                    self._model_name,
                    str(engine),
                    STEP_PROMPT_TOKEN_CLASSES[key[1]],
                    STEP_DECODE_CLASSES[key[2]],
                )
                for counter in self._step_counters
            )
        count, total_seconds, total_prompt, total_decodes = series
        count.inc()
        total_seconds.inc(seconds)
        total_prompt.inc(prompt_tokens)
        total_decodes.inc(decodes)
        kind = "mixed" if prompt_tokens and decodes else "prefill" if prompt_tokens else "decode"
        self._step_kind(engine, kind).observe(seconds)

    def _step_kind(self, engine: int, kind: str) -> Any:
        series = self._step_kinds.get((engine, kind))
        if series is None:
            series = self._step_kinds[(engine, kind)] = self._step_duration.labels(
                self._model_name, str(engine), kind
            )
        return series

    # -- LoRA adapters ---------------------------------------------------------------------

    def enable_lora(self, max_loras: int) -> None:
        """Export the LoRA metrics: `lora_requests_info` (vLLM's) and `lora_adapter_ready`."""
        self._max_loras = max_loras
        self._lora_info = [
            Gauge(
                prefix + "lora_requests_info",
                "Running stats on LoRA requests: adapters with running and waiting requests "
                "(comma-separated); the value is when they were last updated.",
                labelnames=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                registry=self.registry,
            )
            for prefix in self._prefixes
        ]
        self._lora_ready = Gauge(
            "tidegate:lora_adapter_ready",
            "1 for each LoRA adapter this server serves now (loaded and checked).",
            labelnames=("adapter",),
            registry=self.registry,
        )
        self._record_lora_requests()

    def record_lora_adapters(self, names: Iterable[str]) -> None:
        """The adapters served now: each has its ready series, and no other has one."""
        if self._lora_ready is None:
            return
        self._lora_ready.clear()
        for name in names:
            self._lora_ready.labels(adapter=name).set(1)

    def _record_lora_requests(self) -> None:
        running: set[str] = set()
        waiting: set[str] = set()
        for run, wait in self._lora_by_engine.values():
            running.update(run)
            waiting.update(wait)
        labels = {
            "max_lora": str(self._max_loras),
            "running_lora_adapters": ",".join(sorted(running)),
            "waiting_lora_adapters": ",".join(sorted(waiting)),
        }
        for gauge in self._lora_info:
            gauge.clear()  # one series: the current sets, as vLLM exports it
            gauge.labels(**labels).set(time.time())

    # -- KV cache configuration ------------------------------------------------------------

    def record_cache_config(
        self, block_size: int, enable_prefix_caching: bool, cache_dtype: str
    ) -> None:
        """Export `cache_config_info` (vLLM's): value 1, the KV cache described in its labels.

        One series per engine core, once its number of blocks is known (`record_kv_blocks`).
        The Inference Extension's endpoint picker reads `block_size` and `num_gpu_blocks`.
        """
        # Label values as vLLM writes them: str() of each setting ("16", "True").
        self._cache_config = {
            "block_size": str(block_size),
            "cache_dtype": cache_dtype,
            "enable_prefix_caching": str(enable_prefix_caching),
        }
        if not self._cache_info:
            self._cache_info = [
                Gauge(
                    prefix + "cache_config_info",
                    "Information of the KV cache's configuration; the value is always 1.",
                    labelnames=("model_name", "engine", "num_gpu_blocks", *self._cache_config),
                    registry=self.registry,
                )
                for prefix in self._prefixes
            ]
        self._record_cache_info()

    def record_kv_blocks(self, num_blocks: int, engine: int | None = None) -> None:
        """The number of KV blocks one engine core holds (its ready message, or its stats)."""
        engine = self._default_engine if engine is None else engine
        if self._kv_blocks.get(engine) == num_blocks:
            return
        self._kv_blocks[engine] = num_blocks
        self._record_cache_info()

    def _record_cache_info(self) -> None:
        for gauge in self._cache_info:
            gauge.clear()  # the current configuration only, as vLLM exports it
            for engine, num_blocks in sorted(self._kv_blocks.items()):
                gauge.labels(
                    model_name=self._model_name,
                    engine=str(engine),
                    num_gpu_blocks=str(num_blocks),
                    **self._cache_config,
                ).set(1)

    def record_kv_events_port(self, port: int) -> None:
        """Export `tidegate:kv_events_info{port}`: where this server publishes KV events.

        Routers read the port here (router/health.py), so that instances sharing a host, each
        on a port of its own (`--kv-events-port 0`), need no configuration.
        """
        Gauge(
            "tidegate:kv_events_info",
            "The port this server publishes KV-cache events on; the value is always 1.",
            labelnames=("model_name", "port"),
            registry=self.registry,
        ).labels(self._model_name, str(port)).set(1)

    def record_revision(self, track: str, traffic_weight: float | None) -> None:
        """Export `tidegate:revision_info{track,traffic_weight}`: this instance's rollout track.

        Routers read it (router/health.py) and send a canary its share of the role's requests;
        `traffic_weight` is the share in force for a canary (EngineArgs.canary_weight), and
        empty for a stable instance. Value always 1.
        """
        Gauge(
            "tidegate:revision_info",
            "The rollout track this server runs on (stable or canary) and, for a canary, the "
            "share of its role's requests routers send it; the value is always 1.",
            labelnames=("model_name", "track", "traffic_weight"),
            registry=self.registry,
        ).labels(
            self._model_name, track, "" if traffic_weight is None else str(traffic_weight)
        ).set(1)

    # -- Prefill legs run by a decode server ------------------------------------------------

    def enable_prefill_via_header(self) -> None:
        """Export `prefill_header_fallbacks_total{reason}`, every reason from 0.

        Under `tidegate:` only: no vLLM server has it, so no dashboard reads a `vllm:` name.
        """
        self._prefill_fallbacks = Counter(
            "tidegate:prefill_header_fallbacks",
            "Prefill legs run on the instance x-prefiller-host-port names that gave no KV; "
            "the prompt was computed locally instead.",
            labelnames=("model_name", "reason"),
            registry=self.registry,
        )
        for reason in PREFILL_FALLBACK_REASONS:
            self._prefill_fallbacks.labels(self._model_name, reason)

    def record_prefill_header_fallback(self, reason: str) -> None:
        """Count one prefill leg that failed, by one of PREFILL_FALLBACK_REASONS."""
        if self._prefill_fallbacks is not None:
            self._prefill_fallbacks.labels(self._model_name, reason).inc()

    def record_tokens(
        self, prompt_tokens: int, generation_tokens: int, engine: int | None = None
    ) -> None:
        """Count tokens prefilled and generated since the last call."""
        self._inc("prompt_tokens", prompt_tokens, engine)
        self._inc("generation_tokens", generation_tokens, engine)

    def record_first_token(self, ttft_s: float, engine: int | None = None) -> None:
        """Observe one request's time to first token."""
        self._observe("time_to_first_token_seconds", ttft_s, engine)

    def record_inter_token(self, itl_s: float, engine: int | None = None) -> None:
        """Observe the time between two tokens of one request."""
        self._observe("inter_token_latency_seconds", itl_s, engine)

    def record_finished(
        self,
        finish_reason: str,
        e2e_s: float,
        queue_time_s: float | None,
        prompt_tokens: int,
        generation_tokens: int,
        engine: int | None = None,
    ) -> None:
        """Count a finished request and observe its latency and sizes."""
        self._inc("request_success", 1, engine, finished_reason=finish_reason)
        self._observe("e2e_request_latency_seconds", e2e_s, engine)
        if queue_time_s is not None:
            self._observe("request_queue_time_seconds", queue_time_s, engine)
        self._observe("request_prompt_tokens", prompt_tokens, engine)
        self._observe("request_generation_tokens", generation_tokens, engine)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for the /metrics route."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
