"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# Seeds are in [0, SEED_RANGE): torch generators take 64-bit seeds.
SEED_RANGE = 2**63
# How a request's prompt may be pooled into an embedding (SamplingParams.pooling).
POOLING_TYPES = (None, "last", "mean")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one field is set.

    A JSON schema travels as its serialized text, so that the engine caches compiled grammars
    by the exact text and the struct crosses processes as plain msgpack.
    """

    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF) or Lark

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice and "
                f"grammar (got {', '.join(kinds) or 'none'})"
            )
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(
                    "structured outputs choice must be a non-empty list of non-empty strings"
                )
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        )

    @property
    def spec(self) -> str:
        """The constraint's text (choices as a JSON list; "" for json_object)."""
        if self.json_object:
            return ""
        if self.choice is not None:
            import json as _json

            return _json.dumps(self.choice, ensure_ascii=False)
        return getattr(self, self.kind)

    @property
    def key(self) -> tuple[str, str]:
        """What compiled grammars are cached by."""
        return (self.kind, self.spec)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop (names follow OpenAI and vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token
    # Number of top logprobs per prompt token (vLLM's prompt_logprobs; completions' echo with
    # logprobs): every prompt token is computed, none taken from the prefix cache.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit
    # before sampling, greedy rows included (-100 all but bans a token, 100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Grammar-constrained decoding: every sampled token keeps the output a valid prefix.
    structured_outputs: StructuredOutputsParams | None = None
    # Embeddings: the prompt's final hidden states pooled into one vector, which comes with the
    # first sampled token (RequestOutput.pooled). "last": the last prompt token's (what
    # decoder embedding models are trained for); "mean": the average over the prompt, which,
    # like prompt_logprobs, takes no prefix-cache hits.
    pooling: str | None = None
    # Filled by the engine: the model's EOS ids, which end a request unless ignore_eos.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(message)

        if self.n != 1:
            fail(f"n must be 1 in the engine (got {self.n}); the API server fans out n > 1")
        if not 0.0 <= self.temperature <= 100.0:
            fail(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            fail(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            fail(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            fail("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0:
                fail(f"logit_bias keys must be non-negative token ids, got {token_id}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                fail(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if self.pooling not in POOLING_TYPES:
            fail(
                f"pooling must be one of {', '.join(map(str, POOLING_TYPES))}, got {self.pooling!r}"
            )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                fail("allowed_token_ids must not be empty: no token could be sampled")
            if any(t < 0 for t in self.allowed_token_ids):
                fail(f"allowed_token_ids must be non-negative, got {self.allowed_token_ids}")
            if self.structured_outputs is not None:
                # A grammar could forbid every allowed token, leaving nothing to sample.
                fail("allowed_token_ids cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature < _GREEDY_EPS
