"""What crosses the scheduler/runner boundary each step, in both directions."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidegate.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to build its inputs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: what changed since its last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # After preemption the request owns a fresh block list: new_block_ids replaces the old.
    resumed_from_preemption: bool = False


@dataclass
class SchedulerOutput:
    """One step's plan: which requests compute how many tokens, in batch order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Per sampled token: ids and logprobs (sampled token first, then the top-k), and its rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step; requests still mid-prefill get an empty list."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request, on its way to the detokenizer."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
