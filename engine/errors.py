"""Errors the engine raises to its callers; the API server maps each to an HTTP status."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """An engine core or worker process died; no request can complete and the server exits."""


def worker_failed(rank: int, error: str) -> str:
    """What a worker's WorkerFailure (its rank, its traceback) says once it reaches the leader."""
    return f"worker rank {rank} failed:\n{error}"


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (--max-waiting-requests); the client should retry later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(RuntimeError):
    """A request ran past --request-timeout; the engine aborted it and freed its blocks."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request took longer than this server allows (--request-timeout {timeout_s:g} s)"
            " and was aborted"
        )
        self.timeout_s = timeout_s


class RequestRefusedError(ValueError):
    """The engine refused a request it had accepted, before any token (its grammar did not
    compile): a client error, a 400 like any other invalid request."""
