"""Turn request records into the numbers a benchmark reports."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Iterator

from tidegate.engine.bench.load import RequestRecord


def percentiles(values: Iterable[float], scale: float = 1000.0) -> dict[str, float] | None:
    """mean, p50, p90, p99 (nearest rank) of the values, times `scale` (seconds -> ms)."""
    data = sorted(v * scale for v in values)
    if not data:
        return None

    def rank(p: float) -> float:
        return data[min(len(data) - 1, max(0, round(p / 100 * len(data) + 0.5) - 1))]

    return {
        "mean": round(statistics.fmean(data), 3),
        "p50": round(rank(50), 3),
        "p90": round(rank(90), 3),
        "p99": round(rank(99), 3),
        "count": len(data),
    }


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=800,itl_ms=50' -> {'ttft_ms': 800.0, 'itl_ms': 50.0}."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        if key not in ("ttft_ms", "itl_ms", "e2e_ms"):
            raise ValueError(f"unknown SLO {key!r}; use ttft_ms, itl_ms or e2e_ms")
        slo[key] = float(value)
    return slo


def meets(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A good request: completed, and within every SLO (itl_ms bounds its mean gap, TPOT)."""
    if not record.ok or record.ttft is None:
        return False
    if "ttft_ms" in slo and record.ttft * 1000 > slo["ttft_ms"]:
        return False
    if "itl_ms" in slo and record.tpot is not None and record.tpot * 1000 > slo["itl_ms"]:
        return False
    return not ("e2e_ms" in slo and record.e2e * 1000 > slo["e2e_ms"])


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float]) -> dict:
    """Latency percentiles (ms), throughputs and goodput of one run."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3) if duration else 0.0,
        "output_token_throughput": round(output_tokens / duration, 2) if duration else 0.0,
        "total_token_throughput": round(
            (output_tokens + sum(r.prompt_len for r in done)) / duration, 2
        )
        if duration
        else 0.0,
        "ttft_ms": percentiles(r.ttft for r in done if r.ttft is not None),
        "itl_ms": percentiles(gap for r in done for gap in r.itls),
        "tpot_ms": percentiles(r.tpot for r in done if r.tpot is not None),
        "e2e_ms": percentiles(r.e2e for r in done),
    }
    if slo:
        good = sum(meets(r, slo) for r in records)
        summary["slo"] = slo
        summary["goodput"] = round(good / duration, 3) if duration else 0.0
        summary["good_fraction"] = round(good / len(records), 4) if records else 0.0
    errors = sorted({r.error for r in records if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _steady_token_gaps(records: list[RequestRecord]) -> Iterator[tuple[int, float, float]]:
    """(i, arrival of token i - 1, arrival of token i) for every steady stream's tokens."""
    for record in records:
        if record.group == "steady" and record.ok:
            pairs = itertools.pairwise(record.chunk_times)
            for i, (previous, current) in enumerate(pairs, start=1):
                yield i, previous, current


def steady_gaps(
    records: list[RequestRecord], start: float, end: float
) -> tuple[list[float], list[float]]:
    """The steady streams' gaps between tokens that ended by `start`, and those that overlap
    [start, end)."""
    before, during = [], []
    for _, previous, current in _steady_token_gaps(records):
        if current <= start:
            before.append(current - previous)
        elif previous < end:  # the gap overlaps the window
            during.append(current - previous)
    return before, during


def steady_span(records: list[RequestRecord], start: float, end: float) -> tuple[int, int] | None:
    """The first and last token (by index in its stream) of a steady stream whose gap from
    the token before overlaps [start, end): the span of the streams' contexts in a window."""
    indices = [i for i, prev, cur in _steady_token_gaps(records) if cur > start and prev < end]
    return (min(indices), max(indices)) if indices else None


def steady_gaps_in_span(records: list[RequestRecord], span: tuple[int, int]) -> list[float]:
    """The steady streams' gaps ending at tokens first..last of their streams (`steady_span`):
    the same contexts in another run."""
    first, last = span
    return [cur - prev for i, prev, cur in _steady_token_gaps(records) if first <= i <= last]


def arrival_windows(records: list[RequestRecord], events: dict[str, float]) -> dict:
    """Steady streams' gaps before the first long prompt, and while long prompts prefill.

    The arrival window runs from the first long prompt's send time to the moment the last
    long prompt produced its first token (its prefill is then over).
    """
    steady = [r for r in records if r.group == "steady" and r.ok]
    longs = [r for r in records if r.group == "long" and r.ok and r.chunk_times]
    if not steady or not events:
        return {}
    first_arrival = min(events.values())
    window_end = max((r.chunk_times[0] for r in longs), default=first_arrival)
    before, during = steady_gaps(steady, first_arrival, window_end)
    result = {
        "window_s": [round(first_arrival, 3), round(window_end, 3)],
        "steady_itl_before_ms": percentiles(before),
        "steady_itl_during_ms": percentiles(during),
    }
    if result["steady_itl_before_ms"] and result["steady_itl_during_ms"]:
        result["p99_ratio_during_vs_before"] = round(
            result["steady_itl_during_ms"]["p99"] / result["steady_itl_before_ms"]["p99"], 3
        )
    return result
