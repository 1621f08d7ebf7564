"""Seeded, reproducible request sets for the load generator.

Prompts are token-id lists, so a request has exactly the length asked for on any server
that accepts token ids in `/v1/completions` (Tidegate, vLLM).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Token ids drawn for prompts: above the special tokens, inside every test model's vocabulary.
DEFAULT_TOKEN_RANGE = (10, 1000)


@dataclass
class BenchRequest:
    """One request of a workload."""

    prompt: list[int]
    max_tokens: int
    # Requests of a group are reported together (e.g. "steady" and "long").
    group: str = "main"
    # Seconds after the start at which to send; None lets the arrival process decide.
    send_at: float | None = None


@dataclass
class Workload:
    """A named request set, and the moments worth marking on a plot."""

    name: str
    requests: list[BenchRequest]
    events: dict[str, float] = field(default_factory=dict)


def parse_range(text: str) -> tuple[int, int]:
    """'128' or '64-256' -> (low, high), inclusive."""
    low, _, high = text.partition("-")
    lo, hi = int(low), int(high or low)
    if not 0 < lo <= hi:
        raise ValueError(f"bad length range {text!r}: want N or LOW-HIGH with 0 < LOW <= HIGH")
    return lo, hi


def _tokens(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    return [rng.randrange(*token_range) for _ in range(n)]


def random_workload(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> Workload:
    """Independent prompts with lengths drawn uniformly from the ranges."""
    rng = random.Random(seed)
    requests = [
        BenchRequest(
            prompt=_tokens(rng, rng.randint(*input_len), token_range),
            max_tokens=rng.randint(*output_len),
        )
        for _ in range(num_prompts)
    ]
    return Workload("random", requests)


def shared_prefix_workload(
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> Workload:
    """Sessions that share one of `num_prefixes` system prompts, each with its own question."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, token_range) for _ in range(num_prefixes)]
    requests = [
        BenchRequest(
            prompt=prefixes[i % num_prefixes] + _tokens(rng, rng.randint(*suffix_len), token_range),
            max_tokens=rng.randint(*output_len),
            group=f"prefix-{i % num_prefixes}",
        )
        for i in range(num_prompts)
    ]
    return Workload("shared-prefix", requests)


def long_prompt_arrival_workload(
    num_steady: int,
    steady_input_len: int,
    steady_output_len: int,
    long_input_len: tuple[int, int],
    long_arrivals: list[float],
    long_output_len: int,
    seed: int,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> Workload:
    """Steady decode streams from t=0, then long prompts arriving at the given seconds.

    The steady streams' inter-token latency before the first arrival is their baseline;
    during the arrivals it shows whether a long prefill stalls everyone else's tokens.
    """
    rng = random.Random(seed)
    requests = [
        BenchRequest(
            prompt=_tokens(rng, steady_input_len, token_range),
            max_tokens=steady_output_len,
            group="steady",
            send_at=0.0,
        )
        for _ in range(num_steady)
    ]
    requests += [
        BenchRequest(
            prompt=_tokens(rng, rng.randint(*long_input_len), token_range),
            max_tokens=long_output_len,
            group="long",
            send_at=at,
        )
        for at in long_arrivals
    ]
    events = {f"long prompt {i}": at for i, at in enumerate(long_arrivals)}
    return Workload("long-prompt-arrival", requests, events)
