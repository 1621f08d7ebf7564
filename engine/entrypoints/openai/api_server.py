"""The OpenAI-compatible HTTP API of one engine, as a FastAPI app (uvicorn runs it elsewhere)."""

from __future__ import annotations

import importlib.metadata
import time

from fastapi import FastAPI
from starlette.requests import Request as HTTPRequest
from starlette.responses import PlainTextResponse, Response

from tidegate.engine.entrypoints.openai.auth import APIKeyMiddleware, tenant_cache_salt
from tidegate.engine.entrypoints.openai.drain import DrainMiddleware
from tidegate.engine.entrypoints.openai.engine_client import EngineClient, MetricsRenderer
from tidegate.engine.entrypoints.openai.errors import install_error_handlers, model_not_found
from tidegate.engine.entrypoints.openai.openapi import (
    complete_document,
    error_responses,
    generation_responses,
)
from tidegate.engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tidegate.engine.entrypoints.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from tidegate.engine.entrypoints.openai.serving_chat import ChatServing
from tidegate.engine.entrypoints.openai.serving_completion import CompletionServing
from tidegate.engine.entrypoints.openai.serving_tokenization import detokenize, tokenize
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.http_server import Drain

# Probes and scrapers reach these without the API key.
OPEN_PATHS = ("/health", "/metrics", "/version")
_EMPTY_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _version() -> str:
    try:
        return importlib.metadata.version("tidegate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_app(
    engine: EngineClient,
    *,
    served_model_names: list[str],
    model_path: str,
    api_key: str | None = None,
    metrics: MetricsRenderer | None = None,
    cache_salt_header: str | None = None,
    drain: Drain | None = None,
) -> FastAPI:
    """The app serving `engine` under `served_model_names`.

    With `cache_salt_header`, each request's cache_salt is its tenant's, from that header.
    With `drain`, it counts requests in flight for it and refuses new ones once it starts.
    """
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    app = FastAPI(title="Tidegate", version=_version())
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=OPEN_PATHS)
    if drain is not None:
        # Outermost: a request that comes while draining is refused before anything else.
        app.add_middleware(DrainMiddleware, drain=drain)
    completions = CompletionServing(engine)
    chat = ChatServing(engine)
    created = int(time.time())

    def check_model(name: str | None) -> None:
        if name is not None and name not in served_model_names:
            raise model_not_found(name, served_model_names)

    def salt(body: CompletionRequest | ChatCompletionRequest, request: HTTPRequest) -> None:
        if cache_salt_header is not None:
            body.cache_salt = tenant_cache_salt(request.headers, cache_salt_header)

    def check_alive() -> None:
        if engine.is_dead:
            raise EngineDeadError(engine.dead_reason or "an engine process died")

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name, created=created, root=model_path, max_model_len=engine.max_model_len
        )

    @app.post(
        "/v1/completions",
        responses=generation_responses(CompletionResponse, CompletionResponse),
    )
    async def create_completion(body: CompletionRequest, request: HTTPRequest) -> Response:
        check_alive()
        check_model(body.model)
        salt(body, request)
        return await completions.create(body, request)

    @app.post(
        "/v1/chat/completions",
        responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        check_alive()
        check_model(body.model)
        salt(body, request)
        return await chat.create(body, request)

    @app.get("/v1/models", responses=error_responses("4XX"))
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in served_model_names])

    @app.get("/v1/models/{name:path}", responses=error_responses("4XX"))
    async def retrieve_model(name: str) -> ModelCard:
        check_model(name)
        return card(name)

    @app.post("/tokenize", responses=error_responses("4XX"))
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        return tokenize(engine, body)

    @app.post("/detokenize", responses=error_responses("4XX"))
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        return detokenize(engine, body)

    @app.get("/health", response_class=Response, responses=error_responses("503"))
    async def health() -> Response:
        check_alive()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_route() -> Response:
        if metrics is None:
            return Response(b"", media_type=_EMPTY_METRICS_TYPE)
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    complete_document(app, api_key=bool(api_key), open_paths=OPEN_PATHS)
    return app
