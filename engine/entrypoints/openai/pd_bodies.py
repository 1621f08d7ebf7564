"""What each leg of disaggregated serving sends, derived from the client's request body.

The router runs both legs (engine/router/proxy.py); a decode server that honours the
x-prefiller-host-port header runs the prefill leg itself (prefill_via_header.py). Both build
the legs here, so that a prefill instance sees the same body whichever sent it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
# vLLM's classification and scoring routes (serving_score.py); /rerank also in Jina's and
# Cohere's versioned paths. Like embeddings, they pool prompts on the instance they reach.
CLASSIFY_PATHS = ("/classify", "/v1/classify")
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
POOLING_PATHS = (EMBEDDINGS_PATH, *CLASSIFY_PATHS, *SCORE_PATHS, *RERANK_PATHS)
KV_TRANSFER_PARAMS = "kv_transfer_params"
# Where an endpoint picker names the prefill instance of a request it sends to a decode one.
PREFILLER_HEADER = "x-prefiller-host-port"


def client_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body without a kv_transfer_params of its own: only the router sets those."""
    return {key: value for key, value in body.items() if key != KV_TRANSFER_PARAMS}


def needs_prefill(path: str, body: Mapping[str, Any]) -> bool:
    """Whether the request is one prompt with one completion, the shape P/D transfer serves.

    Anything else (n > 1, a batch of prompts, a body the engine will reject) goes to a decode
    instance unchanged, which computes its prompts itself or says what is wrong. So does a
    request for its prompt's logprobs (echo with logprobs, or prompt_logprobs): they come from
    computing the prompt, which a pull of its KV skips.
    """
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return False  # embeddings: the vector comes from computing the prompt
    if body.get("n", 1) not in (1, None):
        return False
    if body.get("prompt_logprobs") is not None or (
        body.get("echo") and body.get("logprobs") is not None
    ):
        return False
    if path == CHAT_PATH:
        return isinstance(body.get("messages"), list)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return True
    # A list of token ids is one prompt; a list of strings or of id lists is a batch.
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def prefill_body(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg: compute the prompt, sample one token, keep the KV for a decode instance."""
    prefill = client_body(body)
    prefill.update(max_tokens=1, stream=False)
    if path == CHAT_PATH:
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    # One token is all the prefill computes; a min_tokens above it would only be refused.
    prefill.pop("min_tokens", None)
    prefill[KV_TRANSFER_PARAMS] = {"do_remote_decode": True}
    return prefill


def decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The decode leg: the client's request, plus where the prefill left its KV blocks."""
    decode = client_body(body)
    if kv_transfer_params is not None:
        decode[KV_TRANSFER_PARAMS] = kv_transfer_params
    return decode
