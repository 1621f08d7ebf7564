"""POST /classify, /score and /rerank (vLLM's routes; /rerank also as /v1 and /v2, Jina's
and Cohere's shape): pooled outputs turned into labels, pair scores and document orders.

Every input or pair runs as an engine request that pools its prompt (SamplingParams.pooling),
like an embedding (serving_embedding.py). What the served model is decides what it answers
(scoring.py): a sequence classifier classifies, and with one label (a cross-encoder) scores
pairs read as one prompt; an embedding model scores pairs by the cosine similarity of their
texts' vectors and classifies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from tidegate.engine.entrypoints.openai.disconnect import cancel_on_disconnect
from tidegate.engine.entrypoints.openai.engine_client import EngineClient
from tidegate.engine.entrypoints.openai.fan_out import (
    ChoiceState,
    build_sub_requests,
    request_ids,
    run_to_completion,
)
from tidegate.engine.entrypoints.openai.protocol import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
)
from tidegate.engine.entrypoints.openai.responses import (
    ClassificationData,
    ClassificationResponse,
    EmbeddingUsage,
    RerankDocument,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
)
from tidegate.engine.messages import LoRARequest
from tidegate.engine.pooling import CLASSIFIER_POOLING, PoolingConfig
from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.scoring import (
    ScoreActivation,
    class_probabilities,
    cosine_similarity,
    rerank_order,
    score_pairs,
)


class ScoringServing:
    """Classifies and scores with a served model: a classifier of `labels` (whose one-label
    scores go through `activation`), or, with no labels, the embedding model that `pooling`
    pools (None: it pools in a way the engine does not, and `no_pooling` says why)."""

    def __init__(
        self,
        engine: EngineClient,
        labels: tuple[str, ...],
        activation: ScoreActivation | None,
        pooling: PoolingConfig | None,
        no_pooling: str = "",
    ) -> None:
        self.engine = engine
        self.labels = labels
        self.activation = activation
        self.pooling = pooling
        self.no_pooling = no_pooling

    async def classify(
        self,
        body: ClassificationRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Response:
        if not self.labels:
            raise ValueError(
                "this model is not a sequence classifier (it ends in an LM head): it "
                "classifies nothing; /v1/embeddings and /score serve it"
            )
        request_id, engine_id = request_ids("classify", http_request)
        states = await self._run(
            engine_id, body.inputs(), CLASSIFIER_POOLING, body, http_request, lora_request, tenant
        )
        data = []
        for index, logits in enumerate(_pooled(request_id, states)):
            probs = class_probabilities(logits)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                ClassificationData(
                    index=index, label=self.labels[best], probs=probs, num_classes=len(probs)
                )
            )
        response = ClassificationResponse(
            id=request_id, model=body.model, data=data, usage=_usage(states)
        )
        return JSONResponse(response.model_dump())

    async def score(
        self,
        body: ScoreRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> Response:
        request_id, engine_id = request_ids("score", http_request)
        pairs = score_pairs(body.text_1, body.text_2)
        scores, states = await self._scores(
            engine_id, pairs, body, http_request, lora_request, tenant
        )
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
        response = ScoreResponse(id=request_id, model=body.model, data=data, usage=_usage(states))
        return JSONResponse(response.model_dump())

    async def rerank(
        self,
        body: RerankRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
        model: str = "",
    ) -> Response:
        request_id, engine_id = request_ids("rerank", http_request)
        pairs = [(body.query, document) for document in body.documents]
        scores, states = await self._scores(
            engine_id, pairs, body, http_request, lora_request, tenant
        )
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
                relevance_score=scores[i],
            )
            for i in rerank_order(scores, body.top_n)
        ]
        total = _usage(states).total_tokens
        response = RerankResponse(
            id=request_id,
            model=body.model or model,
            usage=RerankUsage(total_tokens=total),
            results=results,
        )
        return JSONResponse(response.model_dump())

    async def _scores(
        self,
        engine_id: str,
        pairs: list[tuple[str, str]],
        body: ScoreRequest | RerankRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None,
        tenant: str | None,
    ) -> tuple[list[float], list[ChoiceState]]:
        """Each pair's score, and the engine requests that made them."""
        if self.labels:
            if len(self.labels) != 1 or self.activation is None:
                raise ValueError(
                    f"this classifier has {len(self.labels)} labels; a score comes from a "
                    "one-label classifier (a cross-encoder) or an embedding model"
                )
            tokenizer = self.engine.tokenizer
            prompts = [tokenizer.encode_pair(first, second) for first, second in pairs]
            states = await self._run(
                engine_id, prompts, CLASSIFIER_POOLING, body, http_request, lora_request, tenant
            )
            activation = self.activation
            return [activation(logits[0]) for logits in _pooled(engine_id, states)], states
        if self.pooling is None:
            raise ValueError(f"this server embeds nothing, so it scores nothing: {self.no_pooling}")
        # A bi-encoder: each distinct text embedded once.
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        states = await self._run(
            engine_id,
            texts,
            self.pooling.sampling_params(),
            body,
            http_request,
            lora_request,
            tenant,
        )
        vectors = dict(zip(texts, _pooled(engine_id, states), strict=True))
        return [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs], states

    async def _run(
        self,
        engine_id: str,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        body: ClassificationRequest | ScoreRequest | RerankRequest,
        http_request: HTTPRequest,
        lora_request: LoRARequest | None,
        tenant: str | None,
    ) -> list[ChoiceState]:
        """Check every prompt, then run them all at once (one engine request each)."""
        subs = build_sub_requests(
            self.engine,
            engine_id,
            prompts,
            params,
            1,
            body.cache_salt,
            None,
            lora_request,
            tenant,
            body.priority,
        )
        return await cancel_on_disconnect(http_request, run_to_completion(self.engine, subs))


def _pooled(request_id: str, states: Sequence[ChoiceState]) -> list[list[float]]:
    """Each finished request's pooled output (a vector, or a classifier's logits)."""
    found = []
    for index, state in enumerate(states):
        if state.pooled is None:
            raise RuntimeError(f"{request_id}: input {index} finished without its pooled output")
        found.append(state.pooled)
    return found


def _usage(states: Sequence[ChoiceState]) -> EmbeddingUsage:
    prompt_tokens = sum(state.num_prompt_tokens for state in states)
    return EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
