"""What the router knows of a request when it picks an instance: its route.

The route holds the rendezvous key (the model and the leading prompt text, router/selection.py)
and, when the router has the model's tokenizer, the prompt's token ids exactly as the
engine's API server computes them: the same request model parses the body, the same chat
template renders the conversation (tools included), the same tokenizer encodes it. From
those ids and an instance's block size the router computes the KV cache manager's own block
hashes (engine/core/block_hash.py), cache salt and adapter included, and asks the block
index (router/block_index.py) how long a prefix each instance holds.

A body the engine would refuse has no token ids: it is routed by its key and the instance
answers the 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tidegate.engine.core.block_hash import append_block_hashes
from tidegate.engine.entrypoints.openai.pd_bodies import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
)
from tidegate.engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from tidegate.engine.entrypoints.openai.serving_chat import chat_prompt_token_ids
from tidegate.engine.router.selection import affinity_key, request_model
from tidegate.engine.tokenizer import Tokenizer


@dataclass
class Route:
    """One request's routing facts; block hashes are computed once per (block size, adapter)."""

    key: str
    model: str | None = None
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    _hashes: dict[tuple[int, str | None], list[bytes]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def block_hashes(self, block_size: int, lora_digest: str | None = None) -> list[bytes]:
        """The prompt's full-block hashes as an engine with this block size computes them."""
        if self.token_ids is None:
            return []
        cached = self._hashes.get((block_size, lora_digest))
        if cached is None:
            cached = []
            append_block_hashes(cached, self.token_ids, block_size, self.cache_salt, lora_digest)
            self._hashes[(block_size, lora_digest)] = cached
        return cached


class PromptTokenizer:
    """Token ids of a completion, chat or embeddings body, as the engine's API server
    computes them."""

    def __init__(self, folder: str) -> None:
        self.tokenizer = Tokenizer(folder)

    def token_ids(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """The one prompt's ids; None for a batch, a body the engine refuses, or other paths."""
        try:
            if path == CHAT_PATH:
                chat = ChatCompletionRequest.model_validate(body)
                return chat_prompt_token_ids(self.tokenizer, chat)
            if path == COMPLETIONS_PATH:
                prompts = CompletionRequest.model_validate(body).prompts()
            elif path == EMBEDDINGS_PATH:
                prompts = EmbeddingRequest.model_validate(body).inputs()
            else:
                return None
            if len(prompts) != 1:
                return None
            prompt = prompts[0]
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        except (ValidationError, ValueError, TypeError):
            return None


def request_route(
    path: str,
    body: Mapping[str, Any],
    request_id: str,
    tokenizer: PromptTokenizer | None = None,
) -> Route:
    """The route of a request body; the request id stands in for a body with no prompt."""
    salt = body.get("cache_salt")
    return Route(
        key=affinity_key(body) or request_id,
        model=request_model(body),
        token_ids=tokenizer.token_ids(path, body) if tokenizer is not None else None,
        cache_salt=salt if isinstance(salt, str) else None,
    )
