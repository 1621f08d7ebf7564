"""Response bodies and streamed chunks of the OpenAI-compatible API."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(TypedDict):
    """vLLM's prompt_logprobs entry: one candidate token at one prompt position.

    A TypedDict, not a model: a 4,000-token prompt with 20 candidates a position makes 84,000
    of them, which as models took 0.33 s of the event loop to build, check and dump, and as
    dicts 0.12 s.
    """

    logprob: float
    rank: int | None
    decoded_token: str | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Asked for by prompt_logprobs: per prompt token, token id -> its entry (None first).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A response, or (object and usage aside) one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # A KV producer's answer, for `tidegate router` to pass to a consumer.
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class _PresentOnly(BaseModel):
    """A model whose null fields are left out of its JSON, as OpenAI's deltas and calls are."""

    @model_serializer(mode="wrap")
    def _present_only(self, handler: SerializerFunctionWrapHandler) -> Any:
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The reply: content null when it is only tool calls; tool_calls left out when none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler: SerializerFunctionWrapHandler) -> Any:
        message = handler(self)
        if message.get("tool_calls") is None:
            message.pop("tool_calls", None)
        return message


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None
    # Asked for by prompt_logprobs (vLLM's field): one list, the choices share the prompt.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class DeltaFunctionCall(_PresentOnly):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_PresentOnly):
    """A call's first delta has its id, type and name (arguments ""); later ones, arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_PresentOnly):
    """What a chunk adds to a message; absent fields are left out, not null."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tidegate"
    root: str
    # A LoRA adapter's base model (its served name); None for the base model itself.
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    # encoding_format "float": the values; "base64": their float32 bytes, little-endian.
    embedding: list[float] | str
    index: int


class EmbeddingResponse(BaseModel):
    """POST /v1/embeddings' answer: the inputs' vectors in their order."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class ClassificationData(BaseModel):
    index: int
    label: str  # the likeliest label
    probs: list[float]  # each label's probability, in the model's label order
    num_classes: int


class ClassificationResponse(BaseModel):
    """POST /classify's answer: each input's label probabilities, in input order."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    """POST /score's answer: each pair's score, in pair order."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's place in the request
    document: RerankDocument | None = None  # with return_documents
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """POST /rerank's answer: the documents by descending relevance, top_n of them."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
