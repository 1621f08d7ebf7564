"""What the offline API returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token at one position."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """The generated continuation of one prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    # Per generated token: candidate token id -> Logprob (the sampled token is always present).
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt, its tokens, and what was generated for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # A KV producer's answer: where a consumer pulls this prompt's KV (on the last output).
    kv_transfer_params: dict | None = None
    # With prompt_logprobs, once the first token is out: per prompt token, candidate token id
    # -> Logprob (the prompt's token always present); None for the first, which nothing predicts.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With pooling (SamplingParams.pooling), once the first token is out: the prompt's pooled
    # final hidden states, not normalised.
    pooled: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (LLM.embed): its tokens and the vector."""

    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ClassificationOutput:
    """One prompt's classification (LLM.classify): its tokens, the classifier's logit of
    each label, their probabilities, and the likeliest label."""

    prompt_token_ids: list[int]
    logits: list[float]
    probs: list[float]
    label: str


@dataclass
class ScoringOutput:
    """One pair's score (LLM.score): a cross-encoder's activated logit of the pair, or the
    cosine similarity of an embedding model's two vectors; the tokens it took."""

    score: float
    num_prompt_tokens: int
