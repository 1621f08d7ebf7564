"""Request bodies of the OpenAI-compatible API, as pydantic models that validate themselves.

Unknown fields are ignored (clients send many); fields of features that would change the
answer but are not implemented are refused with a message naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tidegate.engine.entrypoints.openai.request_body import (
    FieldError,
    RequestBody,
    null_is_default,
)
from tidegate.engine.entrypoints.openai.structured_outputs import ConstrainedRequest
from tidegate.engine.entrypoints.openai.tools import (
    ChatTool,
    MessageToolCall,
    NamedToolChoice,
    ToolChoiceMode,
    check_tool_choice,
    tool_constraint,
)
from tidegate.engine.kv_transfer.params import parse_kv_transfer_params
from tidegate.engine.sampling_params import SamplingParams, StructuredOutputsParams

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
    "logit_bias",
    "allowed_token_ids",
)


def _unsupported(name: str, detail: str = "") -> ValueError:
    return ValueError(f"{name} is not supported by this server{detail}")


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingRequest(ConstrainedRequest):
    """The fields completions and chat share; they become one SamplingParams.

    Every field OpenAI's API reference marks nullable takes null: the optional ones here mean
    "not set" by None already; `null_is_default` reads null as the default for the others.
    """

    model: str
    n: int | None = 1
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
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Any = None  # accepted, unused
    cache_salt: str | None = None
    # Token id (as a string) -> bias in [-100, 100]; the engine checks the range and the ids.
    logit_bias: dict[str, float] | None = None
    # vLLM's field: only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Disaggregated serving (set by `tidegate router`): see tidegate.engine.kv_transfer.params.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's field: lower is admitted first under --scheduling-policy priority; any other
    # value than 0 is refused by a server with another policy. Bounded to what crosses to
    # the engine core (a 64-bit integer).
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)

    _null_n_stream = null_is_default("n", "stream")

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
    def _bias_token_ids(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's keys are token ids written as strings: the engine takes them as ints."""
        if not value:
            return None
        bias = {}
        for key, number in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = number
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Engine parameters for one choice (n = 1); raises ValueError for bad values."""
        given = {
            name: getattr(self, name)
            for name in _SAMPLING_FIELDS
            if getattr(self, name) is not None
        }
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.output_constraint(),
            **given,
        )


def _batch(prompt: Any) -> list[str | list[int]]:
    """A checked prompt (`_check_prompt`) as a batch: one string or token-id list is one
    prompt (the empty list too: an empty prompt), a list of them is several."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _check_prompt(prompt: Any, name: str = "prompt") -> Any:
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
        f"{name} must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists"
    )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    # Required, and nullable as in OpenAI's reference: null is the empty prompt, from which
    # the model starts a new document (after its BOS token; a model without one refuses it).
    prompt: str | list[str] | list[int] | list[list[int]] | None
    max_tokens: int | None = 16  # OpenAI's default; null means up to the context limit
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # The prompt before the completion, in the text and (with logprobs) the logprobs.
    echo: bool | None = False
    # vLLM's field: the top logprobs of each prompt token, in the choice's prompt_logprobs.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    _null_echo = null_is_default("echo")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        return "" if prompt is None else _check_prompt(prompt)

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

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0, OpenAI's legacy way to score a text: the prompt alone comes
        back (the engine samples one token, which is dropped)."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token the engine computes: prompt_logprobs, and echo's
        logprobs (the prompt's tokens listed before the completion's)."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, each a string or a token-id list."""
        return _batch(self.prompt)


class ChatMessage(RequestBody):
    """One turn; content is text or a list of {"type": "text", "text": ...} parts.

    An assistant turn may carry the tool calls it made, and a "tool" turn answers one of them.
    """

    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

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

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(
                f"tool_calls belong to assistant messages; this one's role is {self.role!r}"
            )
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError(
                "a message of role 'tool' needs tool_call_id: the id of the call it answers"
            )
        return self

    def for_template(self) -> dict[str, Any]:
        """The turn as Hugging Face chat templates take it."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                message["name"] = self.name
        return message


# What the server itself hands the chat template; chat_template_kwargs may not set them.
TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)


class ChatTemplateFields(RequestBody):
    """How a conversation is rendered through the chat template (vLLM's fields)."""

    # Open a new assistant turn after the messages (the template's generation prompt).
    add_generation_prompt: bool | None = True
    # Leave the final message open, so that the reply continues it (a prefilled answer).
    continue_final_message: bool | None = False
    # More variables for the template, e.g. Qwen3's {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # listed by the template as the model may call them

    _null_template_flags = null_is_default("add_generation_prompt", "continue_final_message")

    @model_validator(mode="after")
    def _template_fields_fit(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError(
                "continue_final_message continues the last message and add_generation_prompt "
                "starts a new one; send add_generation_prompt false with it",
                "continue_final_message",
            )
        taken = sorted(TEMPLATE_NAMES.intersection(self.chat_template_kwargs or {}))
        if taken:
            raise FieldError(
                f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the server "
                "gives the template those (send the request's own fields instead)",
                "chat_template_kwargs",
            )
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them; None without tools."""
        return [tool.for_template() for tool in self.tools] if self.tools else None

    def template_options(self) -> dict[str, Any]:
        """The keyword arguments of render_chat these fields ask for, but the messages."""
        return {
            "tools": self.template_tools(),
            "add_generation_prompt": bool(self.add_generation_prompt),
            "continue_final_message": bool(self.continue_final_message),
            "template_kwargs": self.chat_template_kwargs or {},
        }


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context limit
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's field: the top logprobs of each prompt token, in the response's prompt_logprobs.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # None: "auto" with tools, "none" without (as OpenAI).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # deprecated by OpenAI; refused, naming tools
    function_call: Any = None  # deprecated by OpenAI; refused, naming tool_choice
    # vLLM's: the reply repeats the final message first when it continues it (the final
    # message's role is the reply's: assistant, or any with add_generation_prompt false).
    echo: bool | None = False

    _null_logprobs = null_is_default("logprobs", "echo")

    def echoed_text(self) -> str:
        """What echo puts before each choice's content ("" when nothing)."""
        final = self.messages[-1]
        reply_role = "assistant" if self.add_generation_prompt else final.role
        return (final.content or "") if self.echo and final.role == reply_role else ""

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            # As vLLM: a chat stream's chunks have no place for them.
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [tool.function.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"tools must have distinct function names; {', '.join(map(repr, repeated))} "
                "appears more than once"
            )
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        return check_tool_choice(value)

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none"):
            replacement = (
                'tools (each {"type": "function", "function": {...}})'
                if info.field_name == "functions"
                else "tool_choice"
            )
            raise ValueError(
                f"{info.field_name} is deprecated and not supported by this server; "
                f"send {replacement} instead"
            )
        return value

    @model_validator(mode="after")
    def _tools_fit(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [tool.function.name for tool in self.tools or []]
        if not names:
            if choice not in (None, "none"):
                raise FieldError(
                    f"tool_choice {self._choice_text()} needs tools; this request has none",
                    "tool_choice",
                )
            return self
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(map(repr, names))})",
                "tool_choice",
            )
        constrained = self.constraint_fields()
        if self.tool_choice_mode != "none" and constrained:
            raise FieldError(
                f"tool_choice {self._choice_text()} and {constrained[0]} both decide the "
                f"output's shape; send tool_choice 'none' to use {constrained[0]} with tools",
                "tool_choice",
            )
        return self

    def _choice_text(self) -> str:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return f"naming {choice.function.name!r}"
        return repr(choice or "auto")  # None with tools: the default, auto

    @property
    def tool_choice_mode(self) -> ToolChoiceMode:
        """How tools are used: "none" without tools, "auto" by default with them."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice

    @property
    def named_function(self) -> str | None:
        """The function a named tool_choice calls."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def output_constraint(self) -> StructuredOutputsParams | None:
        """A required or named tool_choice's grammar, else the request's own constraint."""
        mode = self.tool_choice_mode
        if mode == "required" or mode == "named":
            assert self.tools is not None
            return tool_constraint(self.tools, mode, self.named_function, self.parallel_tool_calls)
        return super().output_constraint()

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize: a prompt, or a conversation rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(RequestBody):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None


# OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class PoolingRequestBody(RequestBody):
    """What the bodies of the pooling routes (embeddings, classify, score, rerank) share:
    OpenAI's `user`, and vLLM's prefix-cache tenant salt and admission priority."""

    user: Any = None  # accepted, unused
    cache_salt: str | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)


class InputsRequest(PoolingRequestBody):
    """A pooling body whose `input` is a string, a list of strings, a token-id list, or a list
    of token-id lists: none empty, at most MAX_EMBEDDING_INPUTS."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        value = _check_prompt(value, "input")  # the shapes of a completion's prompt
        inputs = _batch(value)
        if any(len(item) == 0 for item in inputs):
            raise ValueError("input must not be empty (nor hold an empty string or token list)")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"input holds {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} per request"
            )
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a string or a token-id list."""
        return _batch(self.input)


class EmbeddingRequest(InputsRequest):
    """POST /v1/embeddings: one vector per input."""

    encoding_format: Literal["float", "base64"] | None = "float"
    # The leading dimensions kept (Matryoshka models), normalised again.
    dimensions: int | None = Field(default=None, ge=1)
    # vLLM's: whether the vector is scaled to unit length (None: as the model's folder says).
    normalize: bool | None = None

    _null_encoding_format = null_is_default("encoding_format")


class ClassificationRequest(InputsRequest):
    """POST /classify (vLLM's): a sequence classifier's label probabilities per input."""


class ScoreRequest(PoolingRequestBody):
    """POST /score (vLLM's): a score per pair of texts, one text_1 with every text_2 or the
    two lists pairwise."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _texts(cls, value: Any, info: ValidationInfo) -> Any:
        return _check_texts(value, info.field_name or "text")


class RerankRequest(PoolingRequestBody):
    """POST /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's API, as vLLM serves
    them): documents ordered by their score against the query."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    @field_validator("query", mode="before")
    @classmethod
    def _query(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("query must not be empty")
        return value

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError("documents must be a list of strings")
        return _check_texts(value, "documents")


def _check_texts(value: Any, name: str) -> Any:
    """A string or a list of strings, none empty, at most MAX_EMBEDDING_INPUTS of them."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a string or a list of strings")
    if not texts or any(not t for t in texts):
        raise ValueError(f"{name} must not be empty (nor hold an empty string)")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"{name} holds {len(texts)} texts; at most {MAX_EMBEDDING_INPUTS}")
    return value
