"""POST /tokenize and /detokenize: the model's tokenizer, as the engine uses it."""

from __future__ import annotations

from tidegate.engine.entrypoints.openai.engine_client import EngineClient
from tidegate.engine.entrypoints.openai.errors import bad_request
from tidegate.engine.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tidegate.engine.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from tidegate.engine.entrypoints.openai.serving_chat import render_chat


def tokenize(engine: EngineClient, body: TokenizeRequest) -> TokenizeResponse:
    """Token ids of a prompt, or of a conversation exactly as chat would send it."""
    tokenizer = engine.tokenizer
    if body.messages is not None:
        # The template writes BOS itself, so by default no special tokens are added: the
        # count is then exactly what a chat request with these messages uses.
        text = render_chat(tokenizer, body.messages, **body.template_options())
        tokens = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
    return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)


def detokenize(engine: EngineClient, body: DetokenizeRequest) -> DetokenizeResponse:
    """Text of token ids; ids outside the vocabulary are refused."""
    vocab_size = engine.tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"token id {bad} is outside this model's vocabulary [0, {vocab_size:,})", "tokens"
        )
    return DetokenizeResponse(
        prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
    )
