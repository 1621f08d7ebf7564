"""Which instance serves a request: the blocks it holds, else rendezvous hashing; within load.

Requests that share a long prompt prefix should land on the instance that already holds its
KV blocks in its prefix cache. Rendezvous (highest-random-weight) hashing gives every
request key a stable preference order over the instances, and adding or removing one
instance moves only the keys that ranked it first. Affinity yields to load: a hot prefix
must not pile every request onto one instance while others idle.

When the router follows the instances' KV-cache events (router/block_index.py) it knows how
many of a prompt's tokens each instance holds: among the instances within the load bound,
each cached token counts for one, less LOAD_COST_TOKENS for each request of extra load over
the least loaded instance (a queued request delays this one by about that much work), and
never below zero. The best score wins; ties, as when nothing is cached, fall back to
rendezvous order, so that a new prefix still lands where its next requests will.
Every input is the same on two routers fed the same events and loads, and so is the choice.

The key holds the request's `model` as well as its prompt: KV blocks computed under one
LoRA adapter are of no use to another (the engine keys its prefix cache by adapter), so the
same prompt under two adapters is two keys, each with its own instance.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Enough of a prompt to tell shared system prompts and few-shot preambles apart, cheap to hash.
AFFINITY_PREFIX_CHARS = 512
# What one request of extra load is worth in cached prompt tokens: a prefix this long must be
# held to send a request to an instance one request busier than the least loaded one.
LOAD_COST_TOKENS = 256


def affinity_key(body: Mapping[str, Any]) -> str | None:
    """The model name and leading prompt text of a request body (chat or completion)."""
    if "messages" in body:
        prompt: Any = body["messages"]
    elif "prompt" in body:
        prompt = body["prompt"]
    else:
        return None
    if not isinstance(prompt, str):
        # A canonical serialization, so that equal messages give equal keys whatever the
        # key order the client's JSON library chose.
        prompt = json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    # The separator keeps a model name and a prompt from running into another pair's.
    return f"{request_model(body) or ''}\0{prompt[:AFFINITY_PREFIX_CHARS]}"


def request_model(body: Mapping[str, Any]) -> str | None:
    """The request's `model` (the base model or a LoRA adapter's name), if it is a string."""
    model = body.get("model")
    return model if isinstance(model, str) else None


def rendezvous_order(key: str, urls: Sequence[str]) -> list[str]:
    """The instances in the key's order of preference (stable across processes and runs)."""
    return sorted(urls, key=lambda url: (_weight(key, url), url), reverse=True)


def _weight(key: str, url: str) -> int:
    digest = hashlib.sha256(f"{key}\0{url}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True)
class Selector:
    """Chooses among instances by affinity, unless that instance is too loaded.

    An instance may carry at most `slack + slack_ratio * least` more load than the least
    loaded one; the first instance in the key's rendezvous order within that bound wins, so
    an overflowing prefix spills to its second choice, consistently, not to a random one.
    """

    slack: float = 2.0
    slack_ratio: float = 0.25

    def order(
        self,
        key: str,
        loads: Mapping[str, float],
        preferred: Collection[str] = (),
        cached: Mapping[str, int] | None = None,
    ) -> list[str]:
        """Every candidate, best first: those within the load bound, then the rest.

        Within the bound, `cached` (prompt tokens each candidate holds) less the extra load
        decides; then candidates in `preferred` (those where the request's adapter is hot);
        then rendezvous order. Past the bound, candidates yield like any other: an adapter
        hot on one instance, or a prefix held by one, does not keep every request there.
        The rest follow by load, as fallbacks.
        """
        if not loads:
            return []
        least = min(loads.values())
        bound = least + self.slack + self.slack_ratio * least
        ranked = rendezvous_order(key, list(loads))
        rank = {url: i for i, url in enumerate(ranked)}
        cached = cached or {}

        def score(url: str) -> tuple[float, bool, int]:
            # Never below zero: an instance holding nothing of the prompt keeps its place in
            # the rendezvous order, whatever its load within the bound.
            value = max(0.0, cached.get(url, 0) - LOAD_COST_TOKENS * (loads[url] - least))
            return (-value, url not in preferred, rank[url])

        within = sorted((url for url in ranked if loads[url] <= bound), key=score)
        assert within, "the least loaded instance is always within the bound"
        beyond = sorted((url for url in ranked if loads[url] > bound), key=lambda u: loads[u])
        return within + beyond
