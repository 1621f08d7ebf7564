"""POST /v1/embeddings: inputs in, one vector each out.

Each input runs as a request that pools its prompt's final hidden states
(SamplingParams.pooling) and samples the one token that ends it, so embeddings share the
scheduler, the batch and the prefix cache with completions; the vector comes back with that
token, which is dropped. The vector is finished here, as the model's folder or the request
says (pooling.py): cut to `dimensions`, normalised, and encoded as floats or base64.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from tidegate.engine.entrypoints.openai.disconnect import cancel_on_disconnect
from tidegate.engine.entrypoints.openai.engine_client import EngineClient
from tidegate.engine.entrypoints.openai.fan_out import (
    build_sub_requests,
    request_ids,
    run_to_completion,
)
from tidegate.engine.entrypoints.openai.protocol import EmbeddingRequest
from tidegate.engine.entrypoints.openai.request_body import FieldError
from tidegate.engine.entrypoints.openai.responses import (
    Embedding,
    EmbeddingResponse,
    EmbeddingUsage,
)
from tidegate.engine.messages import LoRARequest
from tidegate.engine.pooling import PoolingConfig, base64_embedding, finish_embedding


class EmbeddingServing:
    """Runs embedding requests against an engine, pooling as `pooling` says."""

    def __init__(self, engine: EngineClient, pooling: PoolingConfig) -> None:
        self.engine = engine
        self.pooling = pooling

    async def create(
        self,
        body: EmbeddingRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Response:
        """Validate every input, then embed them all at once (one engine request each)."""
        request_id, engine_id = request_ids("embd", http_request)
        subs = build_sub_requests(
            self.engine,
            engine_id,
            body.inputs(),
            self.pooling.sampling_params(),
            1,
            body.cache_salt,
            None,
            lora_request,
            tenant,
            body.priority,
        )
        states = await cancel_on_disconnect(http_request, run_to_completion(self.engine, subs))
        normalize = self.pooling.normalize if body.normalize is None else body.normalize
        data = []
        for index, state in enumerate(states):
            if state.pooled is None:
                raise RuntimeError(f"{request_id}: input {index} finished without its vector")
            try:
                vector = finish_embedding(state.pooled, normalize, body.dimensions)
            except ValueError as error:
                raise FieldError(str(error), "dimensions") from None
            encoded = base64_embedding(vector) if body.encoding_format == "base64" else vector
            data.append(Embedding(embedding=encoded, index=index))
        prompt_tokens = sum(state.num_prompt_tokens for state in states)
        response = EmbeddingResponse(
            id=request_id,
            model=body.model,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )
        return JSONResponse(response.model_dump())
