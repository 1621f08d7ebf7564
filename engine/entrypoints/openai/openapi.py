"""The OpenAPI document: what each route answers, errors and streams included.

FastAPI documents a route's 200 from its return type and, for every route with input, a 422
that this server never sends (errors.py answers 400 in OpenAI's body instead). The routes
declare their answers with these helpers, and `complete_document` adds what FastAPI cannot
know, so that clients generated from /openapi.json, and schemathesis, can hold the server to it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tidegate.engine.entrypoints.openai.responses import ChatCompletionChunk, ErrorResponse

_COMPONENTS = "#/components/schemas/"
_ERROR_DESCRIPTIONS = {
    "4XX": "The request is refused; the error says why",
    "503": "The engine is not running",
    "504": "The request ran past the server's --request-timeout and was aborted",
}
# Models only streamed responses carry, which no route names.
_STREAMED_ONLY: list[type[BaseModel]] = [ChatCompletionChunk]


def error_responses(*statuses: str) -> dict[int | str, dict[str, Any]]:
    """These statuses (4XX: any 4xx) answered with OpenAI's error body."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def generation_responses(
    body: type[BaseModel], chunk: type[BaseModel]
) -> dict[int | str, dict[str, Any]]:
    """A JSON `body`, or with `stream`, events: `chunk`s, maybe an error, then [DONE]."""
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "contentMediaType": "application/json",
                "contentSchema": {
                    "anyOf": [
                        {"$ref": _COMPONENTS + chunk.__name__},
                        {"$ref": _COMPONENTS + ErrorResponse.__name__},
                    ]
                },
            },
        ]
    }
    event = {"type": "object", "properties": {"data": data}, "required": ["data"]}
    stream = {"text/event-stream": {"itemSchema": event}}
    return {200: {"model": body, "content": stream}, **error_responses("4XX", "503", "504")}


def complete_document(app: FastAPI, api_key: bool, open_paths: Collection[str]) -> None:
    """Add the streamed-only models and, with an API key, the Bearer scheme outside open_paths."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            components = document.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            _, streamed = models_json_schema(
                [(model, "serialization") for model in _STREAMED_ONLY],
                ref_template=_COMPONENTS + "{model}",
            )
            for name, schema in streamed.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            if api_key:
                components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
                for path, operations in document.get("paths", {}).items():
                    if path not in open_paths:
                        for operation in operations.values():
                            operation["security"] = [{"apiKey": []}]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
