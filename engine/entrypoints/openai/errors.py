"""The one place where errors become HTTP statuses and OpenAI's error body."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidegate.engine.entrypoints.openai.responses import ErrorInfo, ErrorResponse
from tidegate.engine.errors import EngineDeadError, EngineOverloadedError, RequestTimeoutError

logger = logging.getLogger(__name__)

# nginx's "client closed request": never seen by a client, keeps disconnects out of the 5xx logs.
CLIENT_CLOSED_REQUEST = 499


class OpenAIError(Exception):
    """An error the API reports to the client as `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


class ClientDisconnectedError(Exception):
    """The client went away before its response was ready; its engine requests were aborted."""


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """400 for a request that is wrong as sent."""
    return OpenAIError(400, message, param=param)


def model_not_found(name: str, served: Sequence[str]) -> OpenAIError:
    """404 for a model name this server does not serve."""
    names = ", ".join(repr(s) for s in served)
    return OpenAIError(
        404,
        f"the model {name!r} does not exist; this server serves {names}",
        param="model",
        code="model_not_found",
    )


def invalid_api_key(missing: bool) -> OpenAIError:
    """401 for a missing or wrong API key."""
    message = (
        "no API key given; send it as 'Authorization: Bearer <key>'"
        if missing
        else "the API key is not valid"
    )
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map any exception to the error the client sees."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        message, param = describe_validation_errors(exc.errors())
        return bad_request(message, param)
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(
            429,
            f"{exc}; retry after {exc.retry_after_s} s",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {exc}", type="server_error")
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(504, str(exc), type="timeout_error", code="request_timeout")
    if isinstance(exc, ClientDisconnectedError):
        return OpenAIError(CLIENT_CLOSED_REQUEST, "the client disconnected", code="client_closed")
    # pydantic's ValidationError is a ValueError too, but one raised inside the server is a bug.
    if isinstance(exc, ValueError) and not isinstance(exc, pydantic.ValidationError):
        return bad_request(str(exc))
    if isinstance(exc, StarletteHTTPException):
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), type=error_type, headers=exc.headers)
    return OpenAIError(500, "internal server error; see the server log", type="server_error")


def error_response(error: OpenAIError) -> JSONResponse:
    """The HTTP response for an error."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A message naming every bad field (one clause per field), and the first field's path."""
    messages: list[str] = []
    fields: list[str] = []  # top-level field of each message
    params: list[str] = []
    for error in errors:
        loc = list(error.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        kind = error.get("type")
        if kind == "json_invalid":
            detail = error.get("ctx", {}).get("error", "invalid JSON")
            where = f" at character {loc[0]}" if loc else ""
            return f"the request body is not valid JSON: {detail}{where}", None
        # A check across fields (request_body.FieldError) names its field itself.
        path = _field_path(loc) or getattr(error.get("ctx", {}).get("error"), "param", "")
        top = path.split(".")[0].split("[")[0]
        if top in fields:
            continue  # a union reports each of its members; one message per field is enough
        fields.append(top)
        params.append(path)
        messages.append(_field_message(path, kind, error))
    return "; ".join(messages) or "the request is not valid", next((p for p in params if p), None)


def _field_message(path: str, kind: str | None, error: Mapping[str, Any]) -> str:
    if kind == "value_error":  # raised by our validators, in words meant for the client
        message = str(error["ctx"]["error"])
        return message if message.startswith(path) else f"{path}: {message}"
    if not path:
        return "the request body must be a JSON object"
    if kind == "missing":
        return f"{path} is required"
    return f"{path}: {error.get('msg', 'invalid value')}"


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: Sequence[str | int]) -> str:
    """`messages[0].content` from pydantic's loc, without the union-member tags it inserts."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.isidentifier() or part in _UNION_TAGS:
            break
        else:
            path += f".{part}" if path else part
    return path


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every exception into OpenAI's error body."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        error = to_openai_error(exc)
        if error.status == 500:
            logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(error)

    async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so the server logs the traceback.
        return error_response(to_openai_error(exc))

    for exc_type in (
        OpenAIError,
        RequestValidationError,
        EngineOverloadedError,
        EngineDeadError,
        RequestTimeoutError,
        ClientDisconnectedError,
        ValueError,
        StarletteHTTPException,
    ):
        app.add_exception_handler(exc_type, handle)
    app.add_exception_handler(Exception, handle_unexpected)
