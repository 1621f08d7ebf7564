"""Which LoRA adapters an instance holds, as its /metrics says: served, and hot.

A request's `model` may name a LoRA adapter. An instance *serves* an adapter it has loaded
and can answer for (`tidegate:lora_adapter_ready{adapter} 1`); an instance that does not
would answer 404, or first load it. An adapter is *hot* on an instance that has requests
of it running or waiting (the `running_lora_adapters` and `waiting_lora_adapters` labels of
vLLM's `lora_requests_info` info gauge, or Tidegate's twin): it already has a batch slot, so
a new request of it does not wait for one.

A metric an instance does not export is unknown (None), not empty: an engine without LoRA,
or a vLLM server without Tidegate's gauge, must not be taken for one that serves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.engine.router.exposition import Exposition, Sample

READY_METRIC = "tidegate:lora_adapter_ready"
# Tidegate's twin first; both carry the same labels.
INFO_METRICS = ("tidegate:lora_requests_info", "vllm:lora_requests_info")
INFO_LIST_LABELS = ("running_lora_adapters", "waiting_lora_adapters")
# Labels that describe the state rather than which engine core reports it.
INFO_STATE_LABELS = (*INFO_LIST_LABELS, "max_lora")
# Every metric read_adapters reads.
ADAPTER_METRICS = (READY_METRIC, *INFO_METRICS)


@dataclass(frozen=True)
class Adapters:
    """An instance's adapters: those it serves and those hot on it (None: not reported)."""

    served: frozenset[str] | None = None
    hot: frozenset[str] | None = None

    def serves(self, name: str) -> bool:
        """Whether the instance is known to answer requests for this adapter."""
        if self.served is not None:
            return name in self.served
        # No readiness gauge (a plain vLLM server): requests of the adapter running or
        # waiting there show it knows the name.
        return self.is_hot(name)

    def is_hot(self, name: str) -> bool:
        """Whether requests of this adapter run or wait on the instance now."""
        return self.hot is not None and name in self.hot


UNKNOWN = Adapters()


def read_adapters(page: Exposition) -> Adapters:
    """The adapters an instance's parsed /metrics reports; None for what it does not export."""
    served = None
    if page.knows(READY_METRIC):
        served = frozenset(
            sample.labels["adapter"]
            for sample in page.series(READY_METRIC)
            if sample.value > 0 and sample.labels.get("adapter")
        )
    hot = None
    if any(page.knows(name) for name in INFO_METRICS):
        hot = frozenset(
            name
            for sample in _latest_info(page)
            for label in INFO_LIST_LABELS
            for name in _split_list(sample.labels.get(label, ""))
        )
    return Adapters(served, hot)


def _latest_info(page: Exposition) -> list[Sample]:
    """The newest info sample of each engine core.

    The info gauge's value is the time its labels were last set, and a series whose labels
    changed stays exported with its old time (prometheus_client never drops a label set):
    only the newest series of a reporter is its present state. Reporters are told apart by
    the labels that are not the state (an `engine` label, say).
    """
    latest: dict[tuple[tuple[str, str], ...], Sample] = {}
    for name in INFO_METRICS:
        for sample in page.series(name):
            reporter = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in INFO_STATE_LABELS)
            )
            if reporter not in latest or sample.value > latest[reporter].value:
                latest[reporter] = sample
    return list(latest.values())


def _split_list(value: str) -> list[str]:
    """The names in a comma-separated label value; empty for an empty one."""
    return [name.strip() for name in value.split(",") if name.strip()]
