"""Errors the engine raises to its callers; the API server maps each to an HTTP status."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """An engine core or worker process died; no request can complete and the server exits."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (--max-waiting-requests); the client should retry later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
