"""Request bodies of the OpenAI-compatible API, as pydantic models that validate themselves.

Unknown fields are ignored (clients send many); fields of features that would change the
answer but are not implemented are refused with a message naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tidegate.engine.kv_transfer.params import parse_kv_transfer_params
from tidegate.engine.sampling_params import SamplingParams

MAX_N = 16
# Request fields passed to SamplingParams as they are; null means the engine's default.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """Where (as `[0].content`) and which lone surrogate a JSON value holds, if any.

    JSON can escape one (`"\\ud800"`) though it is no character: neither the tokenizer nor
    UTF-8 can take it. Walked without recursion, as the nesting is the client's to choose.
    """
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str) and (match := _SURROGATE.search(item)):
            return where, match.group()
        if isinstance(item, dict):
            pending.extend((where, key) for key in item)
            pending.extend((f"{where}.{key}", child) for key, child in item.items())
        elif isinstance(item, list):
            pending.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        found = _lone_surrogate(value)
        if found is not None:
            where, char = found
            raise ValueError(
                f"{info.field_name}{where} is not valid Unicode: it holds the lone surrogate "
                f"{char!r}; a \\uD800-\\uDFFF escape must be one half of a surrogate pair"
            )
        return value


def _unsupported(name: str, detail: str = "") -> ValueError:
    return ValueError(f"{name} is not supported by this server{detail}")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    """The fields completions and chat share; they become one SamplingParams."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Any = None  # accepted, unused
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None
    # Disaggregated serving (set by `tidegate router`): see tidegate.engine.kv_transfer.params.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {n}")
        return n

    @field_validator("kv_transfer_params")
    @classmethod
    def _check_kv_transfer_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        parse_kv_transfer_params(value)  # ValueError naming what is wrong
        return value or None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine parameters for one choice (n = 1); raises ValueError for bad values."""
        given = {
            name: getattr(self, name)
            for name in _SAMPLING_FIELDS
            if getattr(self, name) is not None
        }
        return SamplingParams(n=1, max_tokens=max_tokens, logprobs=logprobs, **given)


def _check_prompt(prompt: Any) -> Any:
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        )

    if isinstance(prompt, str) or is_ids(prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        return prompt
    raise ValueError(
        "prompt must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists"
    )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null means up to the context limit
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        return _check_prompt(prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise _unsupported("echo")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise _unsupported("suffix")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of != n:
            raise _unsupported("best_of", f" (other than equal to n; got {best_of}, n is {n})")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, each a string or a token-id list."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(_Body):
    """One turn; content is text or a list of {"type": "text", "text": ...} parts."""

    role: str
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content parts must have type 'text'; got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)

    def for_template(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context limit
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if value:
            raise _unsupported(str(info.field_name))
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, "none"):
            raise _unsupported(str(info.field_name), " (only 'none')")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, dict) or value.get("type") != "text"):
            raise _unsupported("response_format", " (only {'type': 'text'})")
        return value

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(_Body):
    """POST /tokenize: a prompt, or a conversation rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None
