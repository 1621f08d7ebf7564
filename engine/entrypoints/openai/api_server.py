"""The OpenAI-compatible HTTP API of one engine, as a FastAPI app (uvicorn runs it elsewhere)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from starlette.requests import Request as HTTPRequest
from starlette.responses import PlainTextResponse, Response

from tidegate.engine.entrypoints.openai.auth import (
    APIKeyMiddleware,
    APIKeys,
    as_api_keys,
    following_key_file,
    tenant_cache_salt,
)
from tidegate.engine.entrypoints.openai.drain import DrainMiddleware
from tidegate.engine.entrypoints.openai.engine_client import EngineClient, MetricsRenderer
from tidegate.engine.entrypoints.openai.errors import install_error_handlers, model_not_found
from tidegate.engine.entrypoints.openai.openapi import (
    complete_document,
    error_responses,
    generation_responses,
)
from tidegate.engine.entrypoints.openai.pd_bodies import (
    CHAT_PATH,
    CLASSIFY_PATHS,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    RERANK_PATHS,
    SCORE_PATHS,
)
from tidegate.engine.entrypoints.openai.prefill_via_header import (
    AllowedHosts,
    PrefillViaHeader,
)
from tidegate.engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from tidegate.engine.entrypoints.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ClassificationResponse,
    CompletionResponse,
    DetokenizeResponse,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    RerankResponse,
    ScoreResponse,
    TokenizeResponse,
)
from tidegate.engine.entrypoints.openai.serving_chat import ChatServing
from tidegate.engine.entrypoints.openai.serving_completion import CompletionServing
from tidegate.engine.entrypoints.openai.serving_embedding import EmbeddingServing
from tidegate.engine.entrypoints.openai.serving_lora import LoRAServing
from tidegate.engine.entrypoints.openai.serving_score import ScoringServing
from tidegate.engine.entrypoints.openai.serving_tokenization import detokenize, tokenize
from tidegate.engine.entrypoints.openai.tenants import request_tenant
from tidegate.engine.errors import EngineDeadError
from tidegate.engine.http_server import Drain
from tidegate.engine.messages import LoRARequest
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.pooling import read_pooling_config
from tidegate.engine.scoring import read_score_activation

# Bodies of the routes that run the engine.
EngineRequestBody = (
    CompletionRequest
    | ChatCompletionRequest
    | EmbeddingRequest
    | ClassificationRequest
    | ScoreRequest
    | RerankRequest
)
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
    api_key: APIKeys | str | None = None,
    metrics: MetricsRenderer | None = None,
    cache_salt_header: str | None = None,
    drain: Drain | None = None,
    loras: LoRAServing | None = None,
    allow_runtime_lora_updates: bool = False,
    tool_call_parser: str | None = None,
    prefill_via_header: bool = False,
    on_prefill_fallback: Callable[[str], None] | None = None,
    prefill_hosts: list[str] | None = None,
    pooling: str = "auto",
) -> FastAPI:
    """The app serving `engine` under `served_model_names`.

        With `api_key` (one key, or APIKeys, which follow their file while the lifespan runs),
        every route but the probes, /metrics and /version needs a key.
        With `cache_salt_header`, each request's cache_salt is its tenant's, from that header.
        The engine counts each request against its tenant (tenants.py): that header's value,
        else its API key's digest, else the anonymous tenant.
        With `drain`, it counts requests in flight for it and refuses new ones once it starts.
        With `loras`, a request's `model` may name one of its adapters; with
        `allow_runtime_lora_updates` (which needs `api_key`) adapters load and unload over HTTP.
        With `tool_call_parser`, chat requests with tools may leave tool_choice "auto".
        With `prefill_via_header` (a consumer only), a request whose x-prefiller-host-port header
        names a prefill instance has its prompt computed there first; `on_prefill_fallback` counts
        the legs that failed, by reason; `prefill_hosts` (names or addresses) limits the instances
    the header may name. Its HTTP client lives in the app's lifespan.
    `pooling` ("auto": as the model folder says, or "last" or "mean") is how /v1/embeddings
    pools the final hidden states (pooling.py).
    """
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    keys = as_api_keys(api_key)
    if allow_runtime_lora_updates and (loras is None or keys is None):
        raise ValueError(
            "runtime LoRA updates need enable_lora and an API key: the routes read server paths"
        )
    if prefill_via_header and engine.kv_role != "consumer":
        raise ValueError(
            "prefill_via_header needs a consumer (kv_role consumer): only a decode instance "
            f"pulls KV from a prefill instance; this engine has kv_role {engine.kv_role}"
        )
    prefill = PrefillViaHeader(
        prefill_via_header,
        cache_salt_header,
        on_prefill_fallback,
        allowed=AllowedHosts(prefill_hosts or []),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with prefill.running(), following_key_file(keys):
            yield

    app = FastAPI(title="Tidegate", version=_version(), lifespan=lifespan)
    install_error_handlers(app)
    if keys is not None:
        app.add_middleware(APIKeyMiddleware, keys=keys, open_paths=OPEN_PATHS)
    if drain is not None:
        # Outermost: a request that comes while draining is refused before anything else.
        app.add_middleware(DrainMiddleware, drain=drain)
    completions = CompletionServing(engine)
    chat = ChatServing(engine, tool_call_parser)
    # A folder that pools in a way the engine does not (CLS) still serves completions; its
    # embedding requests are refused with the reason.
    embeddings: EmbeddingServing | None = None
    no_embeddings = ""
    labels = ModelConfig.from_pretrained(model_path).labels
    if labels:
        no_embeddings = (
            "it serves a sequence classifier, whose pooled output is its labels' logits "
            "(/classify, and /score and /rerank with one label)"
        )
    else:
        try:
            embeddings = EmbeddingServing(engine, read_pooling_config(model_path, pooling))
        except ValueError as error:
            no_embeddings = str(error)
    scoring = ScoringServing(
        engine,
        labels,
        read_score_activation(model_path, len(labels)) if labels else None,
        embeddings.pooling if embeddings is not None else None,
        no_embeddings,
    )
    created = int(time.time())

    def check_model(name: str | None) -> None:
        if name is not None and name not in served_model_names:
            raise model_not_found(name, served_model_names)

    def resolve_model(name: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for an unknown name."""
        if loras is None:
            check_model(name)
            return None
        return loras.resolve(name)

    def salt(body: EngineRequestBody, request: HTTPRequest) -> None:
        if cache_salt_header is not None:
            body.cache_salt = tenant_cache_salt(request.headers, cache_salt_header)

    def tenant(request: HTTPRequest) -> str | None:
        return request_tenant(request.headers, cache_salt_header, keyed=keys is not None)

    def check_alive() -> None:
        if engine.is_dead:
            raise EngineDeadError(engine.dead_reason or "an engine process died")

    def admit(body: EngineRequestBody, request: HTTPRequest) -> LoRARequest | None:
        """What every request that runs the engine goes through first: the engine is alive,
        `model` names the base model or an adapter (returned), and the tenant's cache salt."""
        check_alive()
        lora = resolve_model(body.model)
        salt(body, request)
        return lora

    def card(name: str) -> ModelCard:
        lora = loras.registry.get(name) if loras is not None else None
        if lora is not None:
            return ModelCard(
                id=name,
                created=created,
                root=lora.path,
                parent=served_model_names[0],
                max_model_len=engine.max_model_len,
            )
        return ModelCard(
            id=name, created=created, root=model_path, max_model_len=engine.max_model_len
        )

    @app.post(
        COMPLETIONS_PATH,
        responses=generation_responses(CompletionResponse, CompletionResponse),
    )
    async def create_completion(body: CompletionRequest, request: HTTPRequest) -> Response:
        lora = admit(body, request)
        refused = await prefill.prefill(COMPLETIONS_PATH, body, request)
        if refused is not None:
            return refused
        return await completions.create(body, request, lora, tenant(request))

    @app.post(
        CHAT_PATH,
        responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        lora = admit(body, request)
        refused = await prefill.prefill(CHAT_PATH, body, request)
        if refused is not None:
            return refused
        return await chat.create(body, request, lora, tenant(request))

    @app.post(EMBEDDINGS_PATH, response_model=EmbeddingResponse, responses=error_responses("4XX"))
    async def create_embedding(body: EmbeddingRequest, request: HTTPRequest) -> Response:
        lora = admit(body, request)
        if embeddings is None:
            raise ValueError(f"this server embeds nothing: {no_embeddings}")
        return await embeddings.create(body, request, lora, tenant(request))

    async def create_classification(body: ClassificationRequest, request: HTTPRequest) -> Response:
        lora = admit(body, request)
        return await scoring.classify(body, request, lora, tenant(request))

    async def create_score(body: ScoreRequest, request: HTTPRequest) -> Response:
        lora = admit(body, request)
        return await scoring.score(body, request, lora, tenant(request))

    async def create_rerank(body: RerankRequest, request: HTTPRequest) -> Response:
        lora = admit(body, request)
        return await scoring.rerank(body, request, lora, tenant(request), served_model_names[0])

    for paths, response_model, handler in (
        (CLASSIFY_PATHS, ClassificationResponse, create_classification),
        (SCORE_PATHS, ScoreResponse, create_score),
        (RERANK_PATHS, RerankResponse, create_rerank),
    ):
        for path in paths:
            app.add_api_route(
                path,
                handler,
                methods=["POST"],
                response_model=response_model,
                responses=error_responses("4XX"),
                include_in_schema=path.startswith("/v1/"),  # the others are aliases
            )

    @app.get("/v1/models", responses=error_responses("4XX"))
    async def list_models() -> ModelList:
        names = loras.served_names() if loras is not None else served_model_names
        return ModelList(data=[card(name) for name in names])

    @app.get("/v1/models/{name:path}", responses=error_responses("4XX"))
    async def retrieve_model(name: str) -> ModelCard:
        resolve_model(name)
        return card(name)

    if allow_runtime_lora_updates:
        assert loras is not None

        @app.post(
            "/v1/load_lora_adapter",
            response_class=PlainTextResponse,
            responses=error_responses("4XX"),
        )
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            loras.load(body.lora_name, body.lora_path)
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' added successfully."
            )

        @app.post(
            "/v1/unload_lora_adapter",
            response_class=PlainTextResponse,
            responses=error_responses("4XX"),
        )
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            loras.unload(body.lora_name)
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' removed successfully."
            )

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

    complete_document(app, api_key=keys is not None, open_paths=OPEN_PATHS)
    return app
